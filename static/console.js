// The console's only script besides htmx: a flash line for action results and errors,
// and a banner when live updates stop, so a stale page never passes for a healthy one.
(function () {
  "use strict";
  var FLASH_MS = 8000;

  function flash(level, text) {
    var box = document.getElementById("flash");
    if (!box) return;
    var line = document.createElement("div");
    line.className = "flash-line " + (level === "ok" ? "ok" : "bad");
    line.textContent = text;
    box.appendChild(line);
    setTimeout(function () { line.remove(); }, FLASH_MS);
  }

  function stale(isStale) {
    var banner = document.getElementById("stale-banner");
    if (banner) banner.hidden = !isStale;
  }

  document.addEventListener("console-flash", function (event) {
    flash(event.detail.level, event.detail.message);
  });

  function refused(xhr) {
    var detail = xhr.statusText;
    try { detail = JSON.parse(xhr.responseText).detail || detail; } catch (e) { /* not JSON */ }
    flash("bad", xhr.status + ": " + detail);
    if (xhr.status >= 500) stale(true);
  }

  document.addEventListener("htmx:responseError", function (event) {
    refused(event.detail.xhr);
  });

  // A poll can swap out the very form whose request is in flight (a table's "Run now"
  // while the table refreshes).  htmx then handles the answer on the detached form: its
  // HX-Trigger events (the flash line, the refresh) and its error events reach no listener
  // of this document.  So each request is watched from here, and an answer that finds its
  // form gone is played out on the page instead.
  document.addEventListener("htmx:beforeSend", function (event) {
    var elt = event.detail.elt;
    var xhr = event.detail.xhr;
    if (!elt || !xhr) return;
    xhr.addEventListener("load", function () {
      if (elt.isConnected) return;  // htmx delivered it (its onload runs before this)
      if (xhr.status >= 400) { refused(xhr); return; }
      replayTriggers(xhr.getResponseHeader("HX-Trigger"));
    });
  });

  function replayTriggers(header) {
    if (!header) return;
    var events;
    try { events = JSON.parse(header); } catch (e) { events = {}; events[header] = null; }
    Object.keys(events || {}).forEach(function (name) {
      document.body.dispatchEvent(new CustomEvent(name, { bubbles: true, detail: events[name] }));
    });
  }

  document.addEventListener("htmx:sendError", function () { stale(true); });

  // A task's log tails like a terminal: after a refresh the newest lines are in view,
  // unless the reader had scrolled up to read older ones.
  var logAtEnd = true;
  function isLogSwap(event) {
    return event.detail.target && event.detail.target.id === "task-log";
  }
  document.addEventListener("htmx:beforeSwap", function (event) {
    var text = document.getElementById("task-log-text");
    if (isLogSwap(event) && text) {
      logAtEnd = text.scrollTop + text.clientHeight >= text.scrollHeight - 8;
    }
  });
  document.addEventListener("htmx:afterSettle", function (event) {
    var text = document.getElementById("task-log-text");
    if (isLogSwap(event) && text && logAtEnd) text.scrollTop = text.scrollHeight;
  });

  document.addEventListener("htmx:afterRequest", function (event) {
    if (event.detail.successful) stale(false);
  });
})();

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

  document.addEventListener("htmx:responseError", function (event) {
    var xhr = event.detail.xhr;
    var detail = xhr.statusText;
    try { detail = JSON.parse(xhr.responseText).detail || detail; } catch (e) { /* not JSON */ }
    flash("bad", xhr.status + ": " + detail);
    if (xhr.status >= 500) stale(true);
  });

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

// The JSON context editors (textarea[data-json-object]): the text must parse and be a JSON
// object before the form may be sent.  An invalid editor carries a custom validity message,
// so neither htmx nor a plain form submits it, and the reason is shown beside it.  The
// server checks again (422 naming the problem): this only saves a round trip.
(function () {
  "use strict";

  function problem(text) {
    if (!text.trim()) return "";  // empty: the server's default (the original input, or {})
    var value;
    try { value = JSON.parse(text); } catch (e) { return "not valid JSON: " + e.message; }
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      return "must be a JSON object ({...}), not " + (Array.isArray(value) ? "an array" : value === null ? "null" : typeof value);
    }
    return "";
  }

  function check(editor) {
    var message = problem(editor.value);
    editor.setCustomValidity(message ? "The context is " + message : "");
    editor.classList.toggle("invalid", Boolean(message));
    var note = document.querySelector('[data-json-error-for="' + editor.id + '"]');
    if (note) note.textContent = message ? "The context is " + message : "";
    return !message;
  }

  function wire(root) {
    var editors = (root || document).querySelectorAll("textarea[data-json-object]");
    Array.prototype.forEach.call(editors, function (editor) {
      if (editor.dataset.jsonWired) return;
      editor.dataset.jsonWired = "1";
      editor.addEventListener("input", function () { check(editor); });
      check(editor);
    });
  }

  // A plain submit (no htmx) is stopped by the browser's own validation; show why.
  document.addEventListener("submit", function (event) {
    var editors = event.target.querySelectorAll ? event.target.querySelectorAll("textarea[data-json-object]") : [];
    var ok = true;
    Array.prototype.forEach.call(editors, function (editor) { ok = check(editor) && ok; });
    if (!ok) { event.preventDefault(); event.stopPropagation(); }
  }, true);

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { wire(document); });
  } else {
    wire(document);
  }
  document.addEventListener("htmx:load", function (event) { wire(event.target); });
})();

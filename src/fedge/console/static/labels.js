// The label queue's keyboard (issue 14, after CruX's labeler): j / k (or the arrow keys)
// move between predictions, 1-9 choose the focused one's class (its model's classes in
// order), Enter labels it. The form posts as a click would: same CSRF token, same
// server-side checks. Keys typed into a text field are left alone.
(function () {
  "use strict";
  var rows = Array.prototype.slice.call(document.querySelectorAll("#queue tr[data-prediction]"));
  if (!rows.length) { return; }
  var current = 0;
  function focus(index) {
    rows[current].classList.remove("focused");
    current = Math.max(0, Math.min(rows.length - 1, index));
    rows[current].classList.add("focused");
    rows[current].scrollIntoView({ block: "nearest" });
    document.body.dataset.focusedPrediction = rows[current].dataset.prediction;
  }
  focus(0);
  document.addEventListener("keydown", function (event) {
    var target = event.target;
    if (target && (target.tagName === "INPUT" || target.tagName === "TEXTAREA")) { return; }
    if (event.altKey || event.ctrlKey || event.metaKey) { return; }
    var row = rows[current];
    var select = row.querySelector("select[name=label]");
    if (event.key === "j" || event.key === "ArrowDown") {
      focus(current + 1);
    } else if (event.key === "k" || event.key === "ArrowUp") {
      focus(current - 1);
    } else if (/^[1-9]$/.test(event.key) && select && !select.disabled) {
      var choice = Number(event.key) - 1;
      if (choice >= select.options.length) { return; }
      select.selectedIndex = choice;
    } else if (event.key === "Enter" && select && !select.disabled) {
      var form = row.querySelector("form");
      if (form.requestSubmit) { form.requestSubmit(); } else { form.submit(); }
    } else {
      return;
    }
    event.preventDefault();
  });
}());

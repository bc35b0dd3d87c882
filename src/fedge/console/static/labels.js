// The label queue's keyboard (issues 14, 30; after CruX's labeler): j / k (or the arrow
// keys) move, 1-9 choose the focused item's class (its model's classes in order; nothing
// is preselected), Enter labels it without reloading the page and moves to the next
// unlabelled item, u undoes the last label: the item comes back, and the next label
// given replaces it (at the manager and, newest wins, at the station). The form posts
// with the same CSRF token and server-side checks as a click; keys typed into a text
// field are left alone.
(function () {
  "use strict";
  var rows = Array.prototype.slice.call(document.querySelectorAll("#queue tr[data-prediction]"));
  var status = document.getElementById("label-status");
  var total = document.getElementById("queue-total");
  var undone = [];  // labelled rows, the last first to come back
  if (!rows.length) { return; }
  var current = 0;
  function say(text, bad) {
    status.textContent = text;
    status.className = bad ? "error" : "message";
    status.hidden = false;
  }
  function focus(index) {
    rows[current].classList.remove("focused");
    current = Math.max(0, Math.min(rows.length - 1, index));
    rows[current].classList.add("focused");
    rows[current].scrollIntoView({ block: "nearest" });
    document.body.dataset.focusedPrediction = rows[current].dataset.prediction;
  }
  function nextOpen(from) {
    for (var i = from + 1; i < rows.length; i += 1) {
      if (!rows[i].classList.contains("labelled")) { return i; }
    }
    return from;
  }
  function count(delta) {
    var n = parseInt(total.textContent, 10) + delta;
    total.textContent = n + " unlabelled";
  }
  function label(row) {
    var form = row.querySelector("form");
    var select = form.querySelector("select[name=label]");
    if (!select.value) { say("choose a class first: keys 1-9", true); return; }
    var started = performance.now();
    fetch(form.action, {
      method: "POST",
      body: new URLSearchParams(new FormData(form)),
      headers: { "x-fedge-fetch": "1" },
      credentials: "same-origin"
    }).then(function (response) {
      return response.json().catch(function () {
        return { ok: false, message: "refused (" + response.status + "); reload the page" };
      });
    }).then(function (result) {
      if (!result.ok) { say(result.message, true); return; }
      var wasOpen = !row.classList.contains("labelled");
      row.classList.add("labelled");
      row.querySelector("[data-field=labelled]").textContent = "✓ " + select.value;
      undone.push(row);
      if (wasOpen) { count(-1); }
      say(result.message + " (u: undo)", false);
      focus(nextOpen(rows.indexOf(row)));
      document.body.dataset.labelMs = String(Math.round(performance.now() - started));
      document.body.dataset.labelled = String(Number(document.body.dataset.labelled || 0) + 1);
    }).catch(function (error) { say("the label was not sent: " + error, true); });
  }
  function undo() {
    var row = undone.pop();
    if (!row) { say("nothing to undo", true); return; }
    row.classList.remove("labelled");
    row.querySelector("[data-field=labelled]").textContent = "";
    row.querySelector("select[name=label]").selectedIndex = 0;
    count(1);
    focus(rows.indexOf(row));
    say(row.dataset.prediction + " is back: the next label you give replaces the last one", false);
  }
  rows.forEach(function (row, index) {
    row.querySelector("form").addEventListener("submit", function (event) {
      event.preventDefault();
      focus(index);
      label(row);
    });
  });
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
    } else if (event.key === "u") {
      undo();
    } else if (/^[1-9]$/.test(event.key) && select && !select.disabled) {
      var choice = Number(event.key);  // option 0 is "choose…"
      if (choice >= select.options.length) { return; }
      select.selectedIndex = choice;
    } else if (event.key === "Enter" && select && !select.disabled) {
      label(row);
    } else {
      return;
    }
    event.preventDefault();
  });
}());

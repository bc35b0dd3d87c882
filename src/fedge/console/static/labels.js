// The label queue's keyboard (issues 14, 30; after CruX's labeler): j / k (or the arrow
// keys) move, 1-9 choose the focused item's class (its model's classes in order; nothing
// is preselected), Enter labels it without reloading the page and moves to the next
// unlabelled item, u undoes the last label: it is withdrawn at the manager and at the
// station, and the item comes back. The form posts with the same CSRF token and
// server-side checks as a click; keys typed into a text field are left alone.
// A station's image (issue 30, item 3) is fetched from the station through the manager
// when its item is focused, the next open item's too (prefetch), shown from memory (a
// blob: URL, never cached: the console says no-store) and its failure said in words.
// For the benchmark: window.fedgeLabelMs holds, per label, the time from the key to the
// next item's image on screen; window.fedgeImageMs each image's fetch.
(function () {
  "use strict";
  var rows = Array.prototype.slice.call(document.querySelectorAll("#queue tr[data-prediction]"));
  var status = document.getElementById("label-status");
  var total = document.getElementById("queue-total");
  var undone = [];  // labelled rows, the last first to come back
  window.fedgeLabelMs = [];
  window.fedgeImageMs = [];
  if (!rows.length) { return; }
  var images = {};  // prediction id -> promise of its image shown (or failed)
  function image(row) {
    var figure = row && row.querySelector("figure.station-image");
    if (!figure) { return Promise.resolve(null); }
    var id = row.dataset.prediction;
    if (images[id]) { return images[id]; }
    var started = performance.now();
    var caption = figure.querySelector("figcaption");
    caption.textContent = "loading from the station…";
    images[id] = fetch(figure.dataset.src, { credentials: "same-origin" }).then(function (r) {
      if (r.ok) { return r.blob(); }
      return r.json().catch(function () { return { error: "refused (" + r.status + ")" }; })
        .then(function (body) { throw new Error(body.error || ("refused (" + r.status + ")")); });
    }).then(function (blob) {
      var img = figure.querySelector("img");
      return new Promise(function (resolve) {
        img.onload = function () {
          img.hidden = false;
          caption.textContent = "";
          figure.classList.add("shown");
          window.fedgeImageMs.push(performance.now() - started);
          resolve(img);
        };
        img.onerror = function () {
          caption.textContent = "the station sent something that is not an image";
          figure.classList.add("failed");
          resolve(null);
        };
        img.src = URL.createObjectURL(blob);
      });
    }).catch(function (error) {
      delete images[id];  // focusing it again asks again (the station may be back)
      caption.textContent = String(error.message || error);
      figure.classList.add("failed");
      return null;
    });
    return images[id];
  }
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
    var shown = image(rows[current]);
    var ahead = nextOpen(current);
    if (ahead !== current) { image(rows[ahead]); }  // prefetch: one item ahead
    return shown;
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
      return focus(nextOpen(rows.indexOf(row))).then(function () {
        var ms = performance.now() - started;  // until the next item's image is shown
        window.fedgeLabelMs.push(ms);
        document.body.dataset.labelMs = String(Math.round(ms));
        document.body.dataset.labelled = String(Number(document.body.dataset.labelled || 0) + 1);
      });
    }).catch(function (error) { say("the label was not sent: " + error, true); });
  }
  function undo() {
    var row = undone.pop();
    if (!row) { say("nothing to undo", true); return; }
    var form = row.querySelector("form");
    var body = new URLSearchParams();
    body.set("csrf", form.querySelector("input[name=csrf]").value);
    body.set("prediction_id", row.dataset.prediction);
    fetch("/labels/withdraw", {
      method: "POST",
      body: body,
      headers: { "x-fedge-fetch": "1" },
      credentials: "same-origin"
    }).then(function (response) {
      return response.json().catch(function () {
        return { ok: false, message: "refused (" + response.status + "); reload the page" };
      });
    }).then(function (result) {
      if (!result.ok) { undone.push(row); say(result.message, true); return; }
      row.classList.remove("labelled");
      row.querySelector("[data-field=labelled]").textContent = "";
      row.querySelector("select[name=label]").selectedIndex = 0;
      count(1);
      focus(rows.indexOf(row));
      say(result.message, false);
      document.body.dataset.withdrawn = String(Number(document.body.dataset.withdrawn || 0) + 1);
    }).catch(function (error) { undone.push(row); say("the undo was not sent: " + error, true); });
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

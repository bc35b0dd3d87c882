// Relative times (issue 30): every element with data-at (seconds since the epoch) reads
// "13 min ago", recomputed each second from the browser's clock, so a page left open
// keeps ageing what it shows even when nothing new arrives.
(function () {
  "use strict";
  function ago(seconds) {
    if (seconds < 2) { return "just now"; }
    if (seconds < 90) { return Math.round(seconds) + " s ago"; }
    if (seconds < 5400) { return Math.round(seconds / 60) + " min ago"; }
    if (seconds < 129600) { return Math.round(seconds / 3600) + " h ago"; }
    return Math.round(seconds / 86400) + " days ago";
  }
  function tick() {
    var now = Date.now() / 1000;
    document.querySelectorAll("[data-at]").forEach(function (element) {
      var at = element.dataset.at;
      var text = at ? ago(Math.max(0, now - Number(at))) : "never";
      if (element.textContent !== text) { element.textContent = text; }
    });
  }
  window.fedgeTimes = tick;
  tick();
  setInterval(tick, 1000);
}());

// Live fleet figures (issues 14, 30): the server sends every edge's display cells and the
// fleet's health over Server-Sent Events whenever they change; this puts them in place.
// "live" is the server's word (manager serve runs and stations report), not this
// connection's: an open stream over a dead fleet says "not live", with the banner why.
(function () {
  "use strict";
  var marker = document.getElementById("live");
  var banner = document.getElementById("banner");
  var source = new EventSource("/events");
  function show(live, text) {
    if (marker) {
      marker.className = live ? "live on" : "live off";
      marker.textContent = live ? "live" : "not live";
    }
    if (banner) {
      banner.textContent = text;
      banner.hidden = !text;
    }
  }
  source.onmessage = function (event) {
    var payload = JSON.parse(event.data);
    var edges = payload.edges;
    Object.keys(edges).forEach(function (edge) {
      var scope = document.querySelector('[data-edge="' + CSS.escape(edge) + '"]');
      if (!scope) { return; }
      var cells = edges[edge];
      Object.keys(cells).forEach(function (field) {
        var cell = scope.querySelector('[data-field="' + field + '"]');
        if (field === "state" && cell) { cell.className = "state-" + cells[field]; }
        if (field === "last_seen_at") {
          var ago = scope.querySelector('[data-field="ago"]');
          if (ago) { ago.dataset.at = cells[field]; }
        } else if (cell && cell.textContent !== cells[field]) {
          cell.textContent = cells[field];
        }
      });
    });
    if (window.fedgeTimes) { window.fedgeTimes(); }
    show(payload.health.live, payload.health.banner);
    document.body.dataset.liveUpdates = String(Number(document.body.dataset.liveUpdates || 0) + 1);
  };
  source.onerror = function () {
    show(false, "The console lost its connection to its own server; reconnecting.");
  };
}());

// Live fleet figures (issue 14): the server sends every edge's display cells over
// Server-Sent Events whenever they change; this puts them into the table in place.
(function () {
  "use strict";
  var marker = document.getElementById("live");
  var source = new EventSource("/events");
  source.onmessage = function (event) {
    var edges = JSON.parse(event.data);
    Object.keys(edges).forEach(function (edge) {
      var scope = document.querySelector('[data-edge="' + CSS.escape(edge) + '"]');
      if (!scope) { return; }
      var cells = edges[edge];
      Object.keys(cells).forEach(function (field) {
        var cell = scope.querySelector('[data-field="' + field + '"]');
        if (cell && cell.textContent !== cells[field]) { cell.textContent = cells[field]; }
      });
    });
    document.body.dataset.liveUpdates = String(Number(document.body.dataset.liveUpdates || 0) + 1);
    if (marker) { marker.className = "live on"; }
  };
  source.onerror = function () { if (marker) { marker.className = "live off"; } };
}());

// The edge page's trend charts (issue 27): the page carries the series as JSON
// (#trends-data, console/trends.py); uPlot (static/vendor/uplot, vendored) draws them.
// One point per monitor window; null is a gap. The charts are kept in window.fedgeTrends.
(function () {
  "use strict";
  var node = document.getElementById("trends-data");
  if (!node || typeof uPlot === "undefined") return;
  var data = JSON.parse(node.textContent);

  function percent(u, value) {
    return value == null ? "-" : (value * 100).toFixed(1) + "%";
  }
  function psi(u, value) {
    return value == null ? "-" : value.toFixed(3);
  }
  function widthOf(element) {
    return Math.max(320, Math.min(1400, element.clientWidth || 800));
  }

  var rates = document.getElementById("trend-rates");
  var drift = document.getElementById("trend-drift");
  var charts = [
    new uPlot(
      {
        title: "Reject rate, label agreement and estimated accuracy per window",
        width: widthOf(rates),
        height: 280,
        scales: { y: { range: [0, 1] } },
        axes: [
          {},
          {
            values: function (u, ticks) {
              return ticks.map(function (t) { return Math.round(t * 100) + "%"; });
            },
          },
        ],
        series: [
          {},
          { label: "reject rate", stroke: "#c0392b", width: 2, value: percent },
          { label: "label agreement", stroke: "#1f618d", width: 2, value: percent },
          { label: "estimated accuracy (MPP)", stroke: "#1e8449", width: 2, value: percent },
        ],
      },
      [data.at, data.reject_rate, data.agreement, data.estimated_accuracy],
      rates
    ),
    new uPlot(
      {
        title: "Drift per window (largest PSI against the model's reference)",
        width: widthOf(drift),
        height: 220,
        scales: { y: { range: function (u, min, max) { return [0, Math.max(max || 0, data.drift_alert * 1.5)]; } } },
        series: [
          {},
          { label: "input drift", stroke: "#7d3c98", width: 2, value: psi },
          { label: "score drift", stroke: "#b9770e", width: 2, value: psi },
          { label: "significant shift", stroke: "#888", width: 1, dash: [6, 4], value: psi },
        ],
      },
      [
        data.at,
        data.input_drift,
        data.score_drift,
        data.at.map(function () { return data.drift_alert; }),
      ],
      drift
    ),
  ];
  window.fedgeTrends = charts;
  window.addEventListener("resize", function () {
    charts[0].setSize({ width: widthOf(rates), height: 280 });
    charts[1].setSize({ width: widthOf(drift), height: 220 });
  });
})();

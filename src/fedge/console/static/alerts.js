// The alerts page: the header's box ticks or unticks every incident at once (issue 30).
(function () {
  "use strict";
  var all = document.getElementById("pick-all");
  if (!all) { return; }
  all.addEventListener("change", function () {
    document.querySelectorAll('#incidents input[name^="pick-"]').forEach(function (box) {
      box.checked = all.checked;
    });
  });
}());

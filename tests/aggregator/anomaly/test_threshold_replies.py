"""What stations report as their anomaly thresholds is data to check, not to trust.

Real Flower messages through the in-process grid: one station answers in today's form
(held-out and left-out counts), one as an older fedge (held-out counts only), and the
others with a malformed reply, an error reply (too few parts) or a NaN threshold. Each
is kept with its threshold or with the reason it has none; nothing malformed becomes a
threshold an operator could push.
"""

import math
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.aggregator.anomaly.rounds import _thresholds_of_stations
from fedge.aggregator.fleet.grids import NODE_ID_BASE
from fedge.models.anomaly.statistics import GaussianFit
from fedge.sim.grid import InProcessGrid

REPLIES: dict[int, dict[str, Any]] = {
    0: {  # today's station: 10 held out + 30 left out, 2 of the 40 above its threshold
        "anomaly-threshold": 8.5, "anomaly-false-alarm-rate": 0.05,
        "holdout-examples": 10, "holdout-false-alarms": 1, "left-out-examples": 30,
        "calibration-examples": 40, "calibration-false-alarms": 2,
    },
    1: {  # an older fedge: held-out counts only
        "anomaly-threshold": 9.0, "anomaly-false-alarm-rate": 0.05,
        "holdout-examples": 20, "holdout-false-alarms": 1,
    },
    2: {  # fewer parts in all than held out: malformed
        "anomaly-threshold": 7.0, "holdout-examples": 10, "holdout-false-alarms": 0,
        "calibration-examples": 5, "calibration-false-alarms": 0,
    },
    4: {"anomaly-threshold": math.nan, "holdout-examples": 30, "holdout-false-alarms": 0},
}  # fmt: skip


def stations() -> ClientApp:
    app = ClientApp()

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if partition == 3:
            raise ValueError("station st-3: 4 good part(s) ...; it needs at least 19")
        content = RecordDict({"metrics": MetricRecord(REPLIES[partition])})
        return Message(content=content, reply_to=msg)

    return app


def test_each_reply_is_checked_and_kept_with_its_threshold_or_its_reason() -> None:
    grid = InProcessGrid(stations(), 5)
    names = {NODE_ID_BASE + p: f"st-{p}" for p in range(5)}
    model = GaussianFit(count=50, mean=np.zeros((4, 2)), covariance=np.stack([np.eye(2)] * 4),
                        grid=(2, 2))  # fmt: skip
    try:
        results, thresholds = _thresholds_of_stations(grid, ArrayRecord(), model, {}, 60.0, names)
    finally:
        grid.close()
    assert thresholds["st-0"]["threshold"] == 8.5
    assert thresholds["st-0"]["calibration_examples"] == 40
    assert thresholds["st-0"]["holdout_examples"] == 10
    assert thresholds["st-1"]["calibration_examples"] == 20  # its held-out parts
    for bad in ("st-2", "st-4"):
        assert "threshold" not in thresholds[bad]
        assert "malformed threshold reply" in thresholds[bad]["reason"]
    assert "threshold" not in thresholds["st-3"]
    assert "needs at least 19" in thresholds["st-3"]["reason"]
    evaluated = {r.party: r for r in results}
    assert evaluated["st-0"].accuracy == 1 - 2 / 40 and evaluated["st-0"].examples == 40
    assert evaluated["st-1"].accuracy == 1 - 1 / 20
    assert all(evaluated[s].accuracy is None for s in ("st-2", "st-3", "st-4"))

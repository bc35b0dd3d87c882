"""An edge's trends over time (issue 27, item 8): reject rate, label agreement, estimated
accuracy (MPP) and drift, one point per monitor window, drawn on the edge page with uPlot
(static/vendor/uplot, static/trends.js).

A point is one window of the monitor (edge_manager/monitor/tick.py): ``min_window``
consecutive predictions of one model, windows not overlapping. Per window:

- **reject rate**: its rejected predictions over its size (stored with the window);
- **label agreement**: of its predictions that carry a label now, the share whose decision
  the label agrees with (a defect class agrees with "reject", any other with "accept"),
  the same rule as the fleet table's agreement (edge_manager/labels/current.py), read
  at page time so labels given after the window count;
- **estimated accuracy**: the MPP estimate (Ghanta et al., OpML'19) the monitor made
  without labels;
- **drift**: the largest population stability index of the window's image statistics
  (input) and scores (score) against the model's reference; 0.25 is the customary
  "significant shift" (monitoring/drift.py).

A figure the window lacks is ``None`` (a gap in the line, not a zero).
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedge.console import trends_store
from fedge.console.trends_store import LabelledAt, TrendWindow
from fedge.edge_manager.fleet.operations import Fleet
from fedge.monitoring.drift import DriftPolicy

MAX_WINDOWS = 500
"""Windows drawn at most (the newest): at 100 predictions a window, 50,000 predictions."""


@dataclass(frozen=True)
class EdgeTrends:
    edge: str
    at: tuple[float, ...]  # each window's end (unix seconds: uPlot's time axis)
    models: tuple[str, ...]  # each window's model
    reject_rate: tuple[float | None, ...]
    agreement: tuple[float | None, ...]
    labelled: tuple[int, ...]
    estimated_accuracy: tuple[float | None, ...]
    input_drift: tuple[float | None, ...]
    score_drift: tuple[float | None, ...]
    drift_alert: float  # the PSI the monitor calls significant

    @property
    def empty(self) -> bool:
        return not self.at

    def to_plain(self) -> dict[str, Any]:
        """What trends.js reads (a JSON object of equal-length arrays)."""
        return {
            "edge": self.edge,
            "at": list(self.at),
            "models": list(self.models),
            "reject_rate": list(self.reject_rate),
            "agreement": list(self.agreement),
            "labelled": list(self.labelled),
            "estimated_accuracy": list(self.estimated_accuracy),
            "input_drift": list(self.input_drift),
            "score_drift": list(self.score_drift),
            "drift_alert": self.drift_alert,
        }


def trends(
    edge: str,
    windows: Sequence[TrendWindow],
    labelled: Sequence[LabelledAt],
    defects: dict[str, frozenset[str]],
    drift_alert: float = DriftPolicy().psi_alert,
) -> EdgeTrends:
    """The series of ``windows`` (oldest first), agreement from ``labelled`` (the edge's
    labelled predictions in their span) with each model's ``defects`` classes."""
    by_model: dict[str, list[LabelledAt]] = defaultdict(list)
    for item in labelled:
        by_model[item.model].append(item)
    agreement: list[float | None] = []
    counts: list[int] = []
    for window in windows:
        inside = [
            item
            for item in by_model.get(window.model, ())
            if window.window_start <= item.at <= window.window_end
        ]
        positives = defects.get(window.model, frozenset())
        agree = sum((item.decision == "reject") == (item.label in positives) for item in inside)
        agreement.append(agree / len(inside) if inside else None)
        counts.append(len(inside))
    return EdgeTrends(
        edge=edge,
        at=tuple(w.window_end for w in windows),
        models=tuple(w.model for w in windows),
        reject_rate=tuple(
            None if w.rejects is None or w.n <= 0 else w.rejects / w.n for w in windows
        ),
        agreement=tuple(agreement),
        labelled=tuple(counts),
        estimated_accuracy=tuple(w.mpp for w in windows),
        input_drift=tuple(w.input_drift for w in windows),
        score_drift=tuple(w.score_drift for w in windows),
        drift_alert=drift_alert,
    )


def edge_trends(fleet: Fleet, edge: str, limit: int = MAX_WINDOWS) -> EdgeTrends:
    """``edge``'s trends from the manager's store."""
    shown = trends_store.windows(fleet.store, edge, limit)
    if not shown:
        return trends(edge, [], [], {})
    start, end = shown[0].window_start, max(w.window_end for w in shown)
    labelled = trends_store.labelled_between(fleet.store, edge, start, end)
    defects = trends_store.defect_classes(fleet.store, {w.model for w in shown})
    return trends(edge, shown, labelled, defects)

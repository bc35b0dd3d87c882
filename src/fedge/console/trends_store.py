"""The console's reads for an edge's trends: the monitor's windows and the labelled
decisions that fall in them (trends.py draws them).

Each row of ``estimates`` is one monitor window of ``min_window`` predictions of one
model on one edge (edge_manager/monitor/tick.py): its span, its size, its MPP estimate,
and since store migration 8 its rejects and drift. Labels are read at page time, not when
the window was recorded, because operators label after the fact.
"""

from dataclasses import dataclass

from fedge.edge_manager.labels.store import positive_classes
from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class TrendWindow:
    model: str
    window_start: float
    window_end: float
    n: int
    rejects: int | None  # None: recorded before the store kept it
    mpp: float | None
    input_drift: float | None
    score_drift: float | None


@dataclass(frozen=True)
class LabelledAt:
    """A labelled prediction: when it was made, by which model, decided how, labelled what."""

    model: str
    at: float
    decision: str
    label: str


def windows(store: Store, edge: str, limit: int) -> list[TrendWindow]:
    """``edge``'s newest ``limit`` monitor windows, oldest first (the primary key's
    (edge, ...) prefix bounds the walk to this edge's rows)."""
    rows = store.query(
        "SELECT model, window_start, window_end, n, rejects, mpp, input_drift, score_drift "
        "FROM estimates WHERE edge=? ORDER BY window_end DESC LIMIT ?",
        (edge, max(1, limit)),
    )
    return [TrendWindow(**row) for row in reversed(rows)]


def labelled_between(store: Store, edge: str, start: float, end: float) -> list[LabelledAt]:
    """``edge``'s predictions made in [``start``, ``end``] that carry a current label
    (from the labels' side: there are far fewer labels than predictions)."""
    rows = store.query(
        "SELECT p.model, p.at, p.decision, l.label FROM labels l "
        "JOIN predictions p ON p.prediction_id = l.prediction_id "
        "WHERE p.edge=? AND p.at >= ? AND p.at <= ?",
        (edge, start, end),
    )
    return [LabelledAt(**row) for row in rows]


def defect_classes(store: Store, models: set[str]) -> dict[str, frozenset[str]]:
    """The positive (defect) classes of each of ``models`` (none for one not registered)."""
    return {model: frozenset(positive_classes(store.conn, model)) for model in sorted(models)}

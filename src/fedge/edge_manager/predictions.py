"""The predictions that reached the manager, as an operator looks them up.

``fedge predictions list`` finds the ids to label (``fedge labels add``), so the filters
are the questions an operator asks: which station, which model version, which decision,
still unlabelled. Reading only: the store's rows become plain dataclasses here and never
leave this module as rows.
"""

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.labels import history as label_history
from fedge.edge_manager.store import Store

DECISIONS = ("accept", "reject")


@dataclass(frozen=True)
class PredictionFilter:
    """What ``list_predictions`` selects; ``None`` means any. Newest first, ``limit`` rows."""

    edge: str | None = None
    model: str | None = None  # a registry reference, NAME:VERSION
    decision: str | None = None
    unlabelled: bool = False
    limit: int = 20

    def __post_init__(self) -> None:
        if self.decision is not None and self.decision not in DECISIONS:
            raise ManagerError(
                f"decision must be one of {', '.join(DECISIONS)}, not {self.decision!r}"
            )
        if self.model is not None and not _is_ref(self.model):
            raise ManagerError(f"model must be NAME:VERSION, e.g. inspect:1, not {self.model!r}")
        if self.limit < 1:
            raise ManagerError(f"limit must be >= 1, not {self.limit}")


@dataclass(frozen=True)
class LabelView:
    label_id: str
    label: str
    who: str
    at: float
    origin: str  # 'operator' (given at the manager) or 'edge' (given on the station)
    # Set on a label that is no longer current: the label that replaced it, and when.
    replaced_by: str | None = None
    replaced_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PredictionView:
    prediction_id: str
    edge: str
    at: float
    model: str
    decision: str
    threshold: float
    scores: dict[str, float]
    config_version: int
    latency_ms: float
    source: str
    labels: tuple[LabelView, ...]  # the current label, if any (one per prediction)
    replaced_labels: tuple[LabelView, ...] = ()  # relabelled away, oldest first

    @property
    def top_class(self) -> str:
        return max(self.scores, key=lambda name: self.scores[name]) if self.scores else "-"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["labels"] = [label.to_dict() for label in self.labels]
        data["replaced_labels"] = [label.to_dict() for label in self.replaced_labels]
        return data


def _is_ref(value: str) -> bool:
    name, sep, version = value.rpartition(":")
    return bool(sep and name and version.isdigit())


_COLUMNS = (
    "p.prediction_id, p.edge, p.at, p.model, p.decision, p.threshold, p.scores, "
    "p.config_version, p.latency_ms, p.source"
)


def list_predictions(store: Store, selected: PredictionFilter) -> list[PredictionView]:
    """The newest predictions matching ``selected``, with their labels."""
    where: list[str] = []
    params: list[Any] = []
    for column, value in (
        ("p.edge", selected.edge),
        ("p.model", selected.model),
        ("p.decision", selected.decision),
    ):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if selected.unlabelled:
        where.append("NOT EXISTS (SELECT 1 FROM labels l WHERE l.prediction_id = p.prediction_id)")
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    # A redelivered batch is stored once (the batches table), but a prediction id is not a
    # key of this table: GROUP BY keeps one row per id should one ever appear twice.
    rows = store.query(
        f"SELECT {_COLUMNS} FROM predictions p {clause} "
        "GROUP BY p.prediction_id ORDER BY p.at DESC, p.prediction_id LIMIT ?",
        (*params, selected.limit),
    )
    return [_view(store, row) for row in rows]


def get_prediction(store: Store, prediction_id: str) -> PredictionView:
    row = store.one(
        f"SELECT {_COLUMNS} FROM predictions p WHERE p.prediction_id = ? LIMIT 1",
        (prediction_id,),
    )
    if row is None:
        raise ManagerError(
            f"no prediction {prediction_id!r} has reached the manager; see `fedge predictions list`"
        )
    return _view(store, row)


def _view(store: Store, row: dict[str, Any]) -> PredictionView:
    labels = store.query(
        "SELECT label_id, label, who, at, origin FROM labels WHERE prediction_id = ? "
        "ORDER BY at, label_id",
        (row["prediction_id"],),
    )
    scores = json.loads(row["scores"])
    view_id = str(row["prediction_id"])
    return PredictionView(
        prediction_id=str(row["prediction_id"]),
        edge=str(row["edge"]),
        at=float(row["at"]),
        model=str(row["model"]),
        decision=str(row["decision"]),
        threshold=float(row["threshold"]),
        scores={str(k): float(v) for k, v in scores.items()},
        config_version=int(row["config_version"]),
        latency_ms=float(row["latency_ms"]),
        source=str(row["source"]),
        labels=tuple(
            LabelView(
                str(r["label_id"]), str(r["label"]), str(r["who"]), float(r["at"]), str(r["origin"])
            )
            for r in labels
        ),
        replaced_labels=tuple(
            LabelView(
                old.label_id, old.label, old.who, old.at, old.origin.value, replaced_by, replaced_at
            )
            for old, replaced_by, replaced_at in label_history(store.conn, view_id)
        ),
    )


def wait_for_predictions(
    store: Store, selected: PredictionFilter, timeout_s: float, poll_s: float = 0.2
) -> list[PredictionView]:
    """``list_predictions``, polled until it finds any or ``timeout_s`` has passed.

    A station reports its predictions a moment after it scores them (its report
    interval), so a script that has just dropped images asks with a timeout instead of
    sleeping a guessed time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = list_predictions(store, selected)
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(poll_s)

"""Predictions in the manager's store, as operators look them up: the SQL side of
``fedge predictions`` and of the checks that name a prediction.

:mod:`fedge.edge_manager.fleet.predictions` validates what an operator asks for and calls
:func:`find` and :func:`get`; labelling (fleet_labels.py) and evaluation reports
(evaluations.py) look up which edge and model a prediction came from here. Rows become
the frozen :class:`PredictionView` and never leave this module as rows.
"""

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from fedge.edge_manager.labels import store as label_store
from fedge.edge_manager.store import Store


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


@dataclass(frozen=True)
class ScoredBy:
    """The edge a prediction came from and the model (NAME:VERSION) that made it."""

    edge: str
    model: str


_COLUMNS = (
    "p.prediction_id, p.edge, p.at, p.model, p.decision, p.threshold, p.scores, "
    "p.config_version, p.latency_ms, p.source"
)


def find(
    store: Store,
    *,
    edge: str | None,
    model: str | None,
    decision: str | None,
    unlabelled: bool,
    limit: int,
) -> list[PredictionView]:
    """The newest ``limit`` predictions with the given edge, model and decision (None:
    any), only the unlabelled ones with ``unlabelled``; with their labels."""
    where: list[str] = []
    params: list[Any] = []
    for column, value in (("p.edge", edge), ("p.model", model), ("p.decision", decision)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if unlabelled:
        where.append("NOT EXISTS (SELECT 1 FROM labels l WHERE l.prediction_id = p.prediction_id)")
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    # A redelivered batch is stored once (the batches table), but a prediction id is not a
    # key of this table: GROUP BY keeps one row per id should one ever appear twice.
    rows = store.query(
        f"SELECT {_COLUMNS} FROM predictions p {clause} "
        "GROUP BY p.prediction_id ORDER BY p.at DESC, p.prediction_id LIMIT ?",
        (*params, limit),
    )
    return [_view(store, row) for row in rows]


def get(store: Store, prediction_id: str) -> PredictionView | None:
    """``prediction_id`` with its labels (None: it never reached the manager, or was pruned)."""
    row = store.one(
        f"SELECT {_COLUMNS} FROM predictions p WHERE p.prediction_id = ? LIMIT 1",
        (prediction_id,),
    )
    return None if row is None else _view(store, row)


def scored_by(store: Store, prediction_id: str) -> ScoredBy | None:
    """Where ``prediction_id`` came from (None: it never reached the manager)."""
    row = store.one(
        "SELECT edge, model FROM predictions WHERE prediction_id=? LIMIT 1", (prediction_id,)
    )
    return None if row is None else ScoredBy(str(row["edge"]), str(row["model"]))


def other_edges(conn: sqlite3.Connection, edge: str, prediction_ids: Iterable[str]) -> list[str]:
    """The prediction ids among ``prediction_ids`` that an edge other than ``edge``
    reported, sorted (unknown ones are not: the station may have scored them before
    retention pruned them here)."""
    ordered, foreign = sorted(prediction_ids), []
    for start in range(0, len(ordered), 500):  # SQLite's variable limit
        chunk = ordered[start : start + 500]
        marks = ",".join("?" * len(chunk))
        rows = conn.execute(
            f"SELECT DISTINCT prediction_id FROM predictions WHERE prediction_id IN ({marks}) "
            "AND edge != ?",
            (*chunk, edge),
        ).fetchall()
        foreign += [str(row[0]) for row in rows]
    return sorted(foreign)


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
                old.label.label_id,
                old.label.label,
                old.label.who,
                old.label.at,
                old.label.origin.value,
                old.replaced_by,
                old.replaced_at,
            )
            for old in label_store.history(store.conn, view_id)
        ),
    )

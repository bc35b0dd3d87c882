"""Reads of the manager's store for reports, benchmarks and the demo: what happened.

The benchmarks (``fedge bench ...``) and the demo check and report what the fleet did
-- predictions, labels, thumbnails, batches, duplicates, gaps, an edge's row, a
rollout's outcome -- from the manager's own tables; the statements are here, they get
counts, plain values and frozen dataclasses. Each function reads through a
:class:`Store` or a plain connection: a benchmark polls the store read-only from
another thread or process (:func:`read_only`) while the manager it measures writes it.
The timeline of the closed loop is read in timeline_store.py.

One write lives here too, :func:`record_blessing`: the rollout benchmark measures a
rollout, not the gate, so it writes the verdict the gate would have made.
"""

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.edge_manager.fleet.edge_view_store import REPORTED_COLUMNS, ReportedEdge
from fedge.edge_manager.store import Store

Reader = Store | sqlite3.Connection
"""The manager's store, or a (read-only) connection to its file."""


def _rows(db: Reader, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    conn = db.conn if isinstance(db, Store) else db
    return conn.execute(sql, params).fetchall()


def _scalar(db: Reader, sql: str, params: tuple[Any, ...] = ()) -> Any:
    rows = _rows(db, sql, params)
    return rows[0][0] if rows else None


def _in(values: Sequence[str]) -> str:
    return ", ".join("?" for _ in values)


@contextmanager
def read_only(path: Path | str) -> Iterator[sqlite3.Connection]:
    """A fresh read-only connection to the store at ``path``, closed on exit (readable
    while ``manager serve`` writes it: WAL)."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30.0)) as conn:
        yield conn


# -- predictions, labels, thumbnails


def prediction_count(
    db: Reader, *, edge: str | None = None, decision: str | None = None, model: str | None = None
) -> int:
    """How many predictions are stored (of ``edge``, with ``decision``, served by
    ``model`` -- a model ref, ``name:version`` -- each when given)."""
    where = [
        (f"{column}=?", value)
        for column, value in (("edge", edge), ("decision", decision), ("model", model))
        if value is not None
    ]
    clause = " WHERE " + " AND ".join(c for c, _ in where) if where else ""
    return int(_scalar(db, f"SELECT count(*) FROM predictions{clause}", tuple(v for _, v in where)))


def predictions_per_edge(db: Reader) -> dict[str, int]:
    """How many predictions are stored of each edge that has any."""
    rows = _rows(db, "SELECT edge, count(*) FROM predictions GROUP BY edge")
    return {str(edge): int(n) for edge, n in rows}


def prediction_copies(db: Reader, edge: str) -> dict[str, int]:
    """How many rows each of ``edge``'s predictions has (more than one: a duplicate)."""
    rows = _rows(
        db, "SELECT prediction_id, count(*) FROM predictions WHERE edge=? GROUP BY 1", (edge,)
    )
    return {str(prediction_id): int(n) for prediction_id, n in rows}


def prediction_ids(db: Reader, source: str) -> list[str]:
    """The predictions made of ``source`` (an image: ``file:<name>``, ...)."""
    rows = _rows(db, "SELECT prediction_id FROM predictions WHERE source=?", (source,))
    return [str(r[0]) for r in rows]


@dataclass(frozen=True)
class ScoredPrediction:
    """A stored prediction as the demo plots it (``scores``: JSON, class -> score)."""

    edge: str
    model: str
    scores: str
    threshold: float
    source: str


def scored_predictions(db: Reader) -> list[ScoredPrediction]:
    """Every stored prediction: its edge, model, scores, threshold and source."""
    rows = _rows(db, "SELECT edge, model, scores, threshold, source FROM predictions")
    return [ScoredPrediction(*row) for row in rows]


@dataclass(frozen=True)
class LabelledDecision:
    """A label and the decision of the prediction it labels."""

    decision: str
    label: str


def labelled_decisions(db: Reader, model: str) -> list[LabelledDecision]:
    """The current labels of the predictions ``model`` (a model ref) served."""
    rows = _rows(
        db,
        "SELECT p.decision, l.label FROM labels l "
        "JOIN predictions p ON p.prediction_id = l.prediction_id WHERE p.model=?",
        (model,),
    )
    return [LabelledDecision(*row) for row in rows]


def edge_label_ids(db: Reader, edge: str) -> set[str]:
    """Every label ``edge`` itself sent: current ones and those a newer label replaced
    (they moved to the history, issue 15)."""
    rows = _rows(
        db,
        "SELECT label_id FROM labels WHERE edge=? AND origin='edge' UNION ALL "
        "SELECT label_id FROM label_history WHERE edge=? AND origin='edge'",
        (edge, edge),
    )
    return {r[0] for r in rows}


def thumbnail_counts(db: Reader) -> dict[str, int]:
    """How many thumbnails the manager keeps, per edge that has any."""
    rows = _rows(db, "SELECT edge, count(*) AS n FROM thumbnails GROUP BY edge")
    return {str(edge): int(n) for edge, n in rows}


# -- ingest: records, batches, duplicates, gaps, rejections


def telemetry_count(db: Reader) -> int:
    """How many telemetry records are stored (a duplicate counts again)."""
    return int(_scalar(db, "SELECT count(*) FROM telemetry"))


def distinct_telemetry_count(db: Reader) -> int:
    """How many distinct telemetry records are stored (by edge, batch seq and index)."""
    return int(_scalar(db, "SELECT count(*) FROM (SELECT DISTINCT edge, seq, idx FROM telemetry)"))


def batched_records(db: Reader, streams: Sequence[str], *, edge: str | None = None) -> int:
    """How many records the stored batches of ``streams`` (of ``edge``) announced."""
    clause = "edge=? AND " if edge is not None else ""
    params = (*([edge] if edge is not None else []), *streams)
    return int(
        _scalar(
            db,
            f"SELECT coalesce(sum(n_records), 0) FROM batches WHERE {clause}"
            f"stream IN ({_in(streams)})",
            params,
        )
    )


def duplicates_dropped(db: Reader, stream: str) -> int:
    """How many redelivered batches of ``stream`` ingest dropped, over every edge."""
    return int(
        _scalar(db, "SELECT coalesce(sum(duplicates), 0) FROM streams WHERE stream=?", (stream,))
    )


def gap_count(db: Reader, *, edge: str | None = None) -> int:
    """How many gaps are open (of ``edge``)."""
    if edge is None:
        return int(_scalar(db, "SELECT count(*) FROM gaps"))
    return int(_scalar(db, "SELECT count(*) FROM gaps WHERE edge=?", (edge,)))


def rejection_count(db: Reader) -> int:
    """How many messages ingest rejected."""
    return int(_scalar(db, "SELECT count(*) FROM rejections"))


# -- edges, desired configs, deployments


def edge_state(db: Reader, edge: str) -> ReportedEdge | None:
    """``edge``'s row (None: not enrolled)."""
    rows = _rows(db, f"SELECT {REPORTED_COLUMNS} FROM edges WHERE edge=?", (edge,))
    return ReportedEdge(*rows[0]) if rows else None


def edge_states(db: Reader) -> list[ReportedEdge]:
    """Every enrolled edge's row."""
    return [ReportedEdge(*row) for row in _rows(db, f"SELECT {REPORTED_COLUMNS} FROM edges")]


def online_edges(db: Reader) -> list[str]:
    """The edges online now."""
    return [str(r[0]) for r in _rows(db, "SELECT edge FROM edges WHERE state='online'")]


def edges_applied(db: Reader, version: int) -> int:
    """How many edges reported config version ``version`` or a newer one applied."""
    return int(_scalar(db, "SELECT count(*) FROM edges WHERE config_applied >= ?", (version,)))


def unpublished_desired(db: Reader) -> int:
    """How many desired documents the serve loop has not published yet."""
    return int(_scalar(db, "SELECT count(*) FROM desired WHERE published_at IS NULL"))


def config_published_at(db: Reader, version: int) -> list[float]:
    """When each published desired config of ``version`` was published (acknowledged)."""
    rows = _rows(
        db,
        "SELECT published_at FROM desired WHERE kind='config' AND version=? "
        "AND published_at IS NOT NULL",
        (version,),
    )
    return [float(r[0]) for r in rows]


def active_edges(db: Reader, deployment_id: str, *, edge: str | None = None) -> int:
    """How many edges (``edge`` alone, when given) have deployment ``deployment_id``
    active."""
    if edge is None:
        sql = "SELECT count(*) FROM edges WHERE deploy_id=? AND deploy_stage='active'"
        return int(_scalar(db, sql, (deployment_id,)))
    sql = "SELECT count(*) FROM edges WHERE edge=? AND deploy_id=? AND deploy_stage='active'"
    return int(_scalar(db, sql, (edge, deployment_id)))


def restore_failures(db: Reader, edge: str) -> int:
    """How many times ``edge`` reported that restoring its last good model failed."""
    return int(
        _scalar(
            db,
            "SELECT count(*) FROM deploy_events WHERE edge=? AND reason LIKE 'restore_failed%'",
            (edge,),
        )
    )


# -- rollouts and the gate


@dataclass(frozen=True)
class RolloutOutcome:
    state: str
    reason: str
    created_at: float
    finished_at: float | None  # None: still going


def rollout_outcome(db: Reader, rollout_id: str) -> RolloutOutcome | None:
    """Where rollout ``rollout_id`` is, or how it ended (None: no such rollout)."""
    rows = _rows(
        db,
        "SELECT state, reason, created_at, finished_at FROM rollouts WHERE rollout_id=?",
        (rollout_id,),
    )
    return RolloutOutcome(*rows[0]) if rows else None


def rollout_exposed(db: Reader, rollout_id: str) -> int:
    """How many edges rollout ``rollout_id`` moved (no longer waiting)."""
    return int(
        _scalar(
            db,
            "SELECT count(*) FROM rollout_edges WHERE rollout_id=? AND state != 'waiting'",
            (rollout_id,),
        )
    )

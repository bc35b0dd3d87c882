"""The monitor's reads and writes in the manager's store: windows of predictions,
evaluation rows, drift references and MPP predictors -- the SQL side of monitor.py and
monitor_windows.py (the alerts and estimates are alert_store's).

The reads go through indexes (``predictions_edge``, ``evaluations_counts``) and never
walk a table whose size grows with traffic; the monitor runs them outside any write
transaction. The writes take the connection of the short transaction it opened.
"""

import sqlite3
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class WindowRecord:
    """A scored image as stored: a prediction (``rid``, its rowid) or an evaluation row
    (``rid`` 0); scores and stats are the stored JSON text."""

    scores: str
    stats: str  # '' from an agent that sends no image statistics
    at: float
    label: str | None  # the manager's current label, if any
    rid: int = 0
    decision: str = ""  # a prediction's "accept" / "reject" ('' : an evaluation row)
    # Issue 28: whether the part was novel; None where no anomaly verdict was made (no
    # anomaly model beside the classifier, or no anomaly threshold set; evaluation rows).
    novel: bool | None = None
    # ... its anomaly score and the threshold it was judged against (None: not known).
    anomaly_score: float | None = None
    anomaly_threshold: float | None = None


@dataclass(frozen=True)
class StoredReference:
    """A persisted prediction reference: its last rowid and its rows as JSON."""

    last_rowid: int
    rows: str


@dataclass(frozen=True)
class StoredPredictor:
    predictor: str  # MppPredictor.to_json()
    n_rows: int  # the evaluation rows it was fitted on


_COLUMNS = (
    "p.rowid AS rid, p.at, p.scores, p.stats, p.decision, l.label, p.novel, "
    "p.anomaly_score, p.anomaly_threshold"
)
# The edge's newest rows through predictions_edge (edge, rowid), a bounded walk: no
# predictions index on (edge, model), which every ingested row would have to update.
_NEWEST_SQL = (
    f"SELECT {_COLUMNS} FROM (SELECT rowid AS r FROM predictions WHERE edge=? "
    "ORDER BY rowid DESC LIMIT ?) AS n CROSS JOIN predictions p ON p.rowid = n.r "
    "LEFT JOIN labels l ON l.prediction_id = p.prediction_id "
    "WHERE p.model=? ORDER BY p.rowid DESC LIMIT ?"
)
_FIRST_SQL = (
    f"SELECT {_COLUMNS} FROM predictions p LEFT JOIN labels l "
    "ON l.prediction_id = p.prediction_id "
    "WHERE p.edge=? AND p.model=? ORDER BY p.rowid LIMIT ?"
)
# A held-out image's manager label; a re-lit copy ("<id>~k") takes its image's.
_FIT_SQL = (
    "SELECT e.scores, e.stats, e.at, l.label FROM evaluations e JOIN labels l "
    "ON l.prediction_id = (CASE WHEN instr(e.prediction_id, '~') > 0 "
    "THEN substr(e.prediction_id, 1, instr(e.prediction_id, '~') - 1) "
    "ELSE e.prediction_id END) WHERE e.model=?"
)


def create_evaluation_counts_index(store: Store) -> None:
    # Here, not in store.SCHEMA: `augmented` is added after SCHEMA runs on old stores.
    store.conn.execute(
        "CREATE INDEX IF NOT EXISTS evaluations_counts ON evaluations (model, edge, augmented)"
    )


# ---------------------------------------------------------------- what changed since a tick


def serving(store: Store) -> list[tuple[str, str]]:
    """(edge, model) of every edge serving a model."""
    return [
        (str(r["edge"]), str(r["serving"]))
        for r in store.query("SELECT edge, serving FROM edges WHERE serving != ''")
    ]


def newest_relabel(store: Store) -> int:
    """The newest rowid of the label history (0: nothing was ever relabelled)."""
    return int(store.scalar("SELECT coalesce(max(rowid), 0) FROM label_history"))


def newest_prediction(store: Store, edge: str) -> int:
    """The newest rowid of ``edge``'s predictions (0: none)."""
    return int(
        store.scalar("SELECT coalesce(max(rowid), 0) FROM predictions WHERE edge=?", (edge,))
    )


def evaluation_counts(store: Store, models: set[str]) -> dict[tuple[str, str], tuple[int, int]]:
    """Per (model, edge) of ``models``: all evaluation rows, and those of images as they
    are (``augmented = 0``); read from the ``evaluations_counts`` index alone."""
    if not models:
        return {}
    marks = ",".join("?" * len(models))
    rows = store.query(
        "SELECT model, edge, count(*) AS n, coalesce(sum(augmented = 0), 0) AS here "
        f"FROM evaluations WHERE model IN ({marks}) GROUP BY model, edge",
        tuple(sorted(models)),
    )
    return {(str(r["model"]), str(r["edge"])): (int(r["n"]), int(r["here"])) for r in rows}


# ---------------------------------------------------------------- windows and references


def newest_predictions(
    store: Store, edge: str, model: str, scan: int, limit: int
) -> list[WindowRecord]:
    """The newest ``limit`` predictions of ``model`` among ``edge``'s newest ``scan``,
    newest first, with their current labels."""
    return [_record(r) for r in store.query(_NEWEST_SQL, (edge, scan, model, limit))]


def first_predictions(store: Store, edge: str, model: str, limit: int) -> list[WindowRecord]:
    """The first ``limit`` predictions of ``model`` on ``edge`` still stored, oldest first."""
    return [_record(r) for r in store.query(_FIRST_SQL, (edge, model, limit))]


def evaluation_reference(store: Store, edge: str, model: str) -> list[WindowRecord]:
    """``model``'s evaluation rows on ``edge``: one per held-out image, as it is."""
    # One row per held-out image (the gate may have evaluated the model twice), as it is:
    # a re-lit copy would widen the reference and hide lighting drift.
    rows = store.query(
        "SELECT scores, stats, max(at) AS at, NULL AS label FROM evaluations "
        "WHERE edge=? AND model=? AND augmented = 0 GROUP BY prediction_id",
        (edge, model),
    )
    return [_record(r) for r in rows]


@dataclass(frozen=True)
class Deployed:
    """The newest deployment of a model to an edge, as the edge reported it."""

    deployment_id: str
    first_at: float  # the manager's receive time of the edge's first report on it
    passed_at: float | None  # ... and of its probation's pass (None: not yet)


# The pass as the rollout reads it (rollout/health_store.passed_at): ``passed``, or an
# agent's "active, not on probation" (a proven model; an agent of before sends no other).
_PASSED = "(stage='passed' OR (stage='active' AND reason LIKE 'not on probation%'))"


def deployed(store: Store, edge: str, model: str) -> Deployed | None:
    """The newest deployment of ``model`` (``name:version``) that ``edge`` reported on,
    and when it passed its probation there; None: no deployment of it known at ``edge``
    (a model served before deployments were recorded, or whose events retention pruned)."""
    row = store.one(
        "SELECT e.deployment_id AS id, min(e.at) AS first, max(e.at) AS last "
        "FROM deploy_events e "
        "JOIN deployments d ON d.deployment_id = e.deployment_id WHERE e.edge=? "
        "AND d.model_name || ':' || d.model_version = ? GROUP BY e.deployment_id "
        "ORDER BY last DESC LIMIT 1",
        (edge, model),
    )
    if row is None:
        return None
    passed = store.scalar(
        f"SELECT min(at) FROM deploy_events WHERE edge=? AND deployment_id=? AND {_PASSED}",
        (edge, str(row["id"])),
    )
    return Deployed(str(row["id"]), float(row["first"]), None if passed is None else float(passed))


def settled_predictions(
    store: Store, edge: str, model: str, since: float, scan: int, limit: int
) -> list[WindowRecord]:
    """The first ``limit`` predictions of ``model`` among ``edge``'s newest ``scan`` whose
    batch the manager received at or after ``since`` (its clock, never the station's),
    oldest first: a bounded walk of ``predictions_edge``, like :func:`newest_predictions`."""
    rows = store.query(
        f"SELECT {_COLUMNS} FROM (SELECT rowid AS r FROM predictions WHERE edge=? "
        "ORDER BY rowid DESC LIMIT ?) AS n CROSS JOIN predictions p ON p.rowid = n.r "
        "JOIN batches b ON b.edge = p.edge AND b.stream = 'predictions' AND b.seq = p.seq "
        "LEFT JOIN labels l ON l.prediction_id = p.prediction_id "
        "WHERE p.model=? AND b.received_at >= ? ORDER BY p.rowid LIMIT ?",
        (edge, scan, model, since, limit),
    )
    return [_record(r) for r in rows]


def drift_reference(store: Store, edge: str, model: str) -> StoredReference | None:
    row = store.one(
        "SELECT last_rowid, rows FROM drift_references WHERE edge=? AND model=?", (edge, model)
    )
    return None if row is None else StoredReference(int(row["last_rowid"]), str(row["rows"]))


def save_drift_reference(
    conn: sqlite3.Connection,
    edge: str,
    model: str,
    reference: tuple[int, int, str],
    now: float,
) -> None:
    """A prediction reference: its first and last rowid and its rows as JSON."""
    conn.execute(
        "INSERT OR REPLACE INTO drift_references (edge, model, first_rowid, "
        "last_rowid, rows, created_at) VALUES (?,?,?,?,?,?)",
        (edge, model, *reference, now),
    )


# ---------------------------------------------------------------- the MPP predictor


def fit_rows(store: Store, model: str) -> list[WindowRecord]:
    """Every evaluation row of ``model`` whose image has a manager label, with it."""
    return [_record(r) for r in store.query(_FIT_SQL, (model,))]


def stored_predictor(store: Store, model: str) -> StoredPredictor | None:
    row = store.one("SELECT predictor, n_rows FROM mpp_models WHERE model=?", (model,))
    return None if row is None else StoredPredictor(str(row["predictor"]), int(row["n_rows"]))


def save_predictor(
    conn: sqlite3.Connection,
    model: str,
    predictor: str,
    n_rows: int,
    accuracy: float,
    now: float,
) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO mpp_models (model, predictor, n_rows, accuracy, "
        "fitted_at) VALUES (?,?,?,?,?)",
        (model, predictor, n_rows, accuracy, now),
    )


def _record(row: dict[str, Any]) -> WindowRecord:
    label = row.get("label")
    return WindowRecord(
        scores=row["scores"],
        stats=row["stats"],
        at=float(row["at"]),
        label=None if label is None else str(label),
        rid=int(row.get("rid") or 0),
        decision=str(row.get("decision") or ""),
        novel=None if row.get("novel") is None else bool(row["novel"]),
        anomaly_score=_real(row.get("anomaly_score")),
        anomaly_threshold=_real(row.get("anomaly_threshold")),
    )


def _real(value: Any) -> float | None:
    return None if value is None else float(value)

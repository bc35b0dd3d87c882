"""The label queue's reads over the manager's store: unlabelled predictions, filtered.

:mod:`fedge.console.queue` orders and pages them; only rows' values leave this module.
"""

from dataclasses import dataclass
from typing import Any

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class Unlabelled:
    prediction_id: str
    edge: str
    at: float
    model: str
    decision: str
    threshold: float
    scores: str  # a JSON object: class -> score
    source: str
    # Issue 28: over the station's anomaly threshold and not a known defect (queue.py
    # puts it first: PredictionRecord.novel), and the anomaly model's score (None: none
    # served beside the classifier).
    novel: bool = False
    anomaly_score: float | None = None


def _where(edge: str, model: str, decision: str) -> tuple[str, list[Any]]:
    where = ["NOT EXISTS (SELECT 1 FROM labels l WHERE l.prediction_id = p.prediction_id)"]
    params: list[Any] = []
    for column, value in (("p.edge", edge), ("p.model", model), ("p.decision", decision)):
        if value:
            where.append(f"{column} = ?")
            params.append(value)
    return " AND ".join(where), params


def unlabelled(store: Store, edge: str, model: str, decision: str, limit: int) -> list[Unlabelled]:
    """The newest ``limit`` unlabelled predictions of ``edge``, ``model`` and ``decision``
    ('' : any): the novel ones first (so however large the backlog, none is left out of
    the ``limit``), newest first within each."""
    where, params = _where(edge, model, decision)
    return [
        Unlabelled(
            str(i),
            str(e),
            float(at),
            str(m),
            str(d),
            float(t),
            str(s),
            str(src),
            bool(novel or 0),
            None if score is None else float(score),
        )
        for i, e, at, m, d, t, s, src, novel, score in store.conn.execute(
            "SELECT p.prediction_id, p.edge, p.at, p.model, p.decision, p.threshold, p.scores, "
            f"p.source, max(p.novel), max(p.anomaly_score) FROM predictions p WHERE {where} "
            "GROUP BY p.prediction_id ORDER BY max(p.novel) DESC, p.at DESC, p.prediction_id "
            "LIMIT ?",
            (*params, limit),
        )
    ]


def unlabelled_count(store: Store, edge: str, model: str, decision: str) -> int:
    where, params = _where(edge, model, decision)
    row = store.conn.execute(
        f"SELECT count(DISTINCT p.prediction_id) FROM predictions p WHERE {where}", params
    ).fetchone()
    return int(row[0])


def choices(store: Store) -> tuple[list[str], list[str]]:
    """The stations and models that have predictions, for the queue's filters."""
    edges = [str(r[0]) for r in store.conn.execute("SELECT DISTINCT edge FROM predictions")]
    models = [str(r[0]) for r in store.conn.execute("SELECT DISTINCT model FROM predictions")]
    return sorted(edges), sorted(models)

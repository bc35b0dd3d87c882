"""Evaluations in the manager's store: the requests sent, the stations' reports and the
gate's verdicts -- the SQL side of evaluations.py and gating.py.

Ingest stores a station's report through :mod:`fedge.edge_manager.gate.reports` (which
checks it first), inside ingest's transaction: those writes take its connection. The
gate (:mod:`fedge.edge_manager.gate.run`) reads the answers here and records its verdict
in ``gate_results``, the model's lineage record of blessing.
"""

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager.gate.verdict import Scored
from fedge.edge_manager.store import Store
from fedge.protocols import codec
from fedge.protocols.evaluation import (
    EvaluationItem,
    EvaluationReport,
    EvaluationRequest,
    EvaluationStatus,
)

EVALUATE = "evaluate"  # the desired-document kind (Fleet's `desired` table)


@dataclass(frozen=True)
class ReportRow:
    edge: str
    status: EvaluationStatus
    reason: str  # the station's
    holdout: int
    items: int  # as the station sent them
    foreign_items: int = 0  # dropped here: on other stations' predictions
    rejected_items: int = 0  # dropped here: scores not of the model's classes
    dropped_reason: str = ""


@dataclass(frozen=True)
class StoredVerdict:
    name: str
    version: int
    blessed: bool
    evidence: dict[str, Any]
    eval_id: str
    at: float


# ---------------------------------------------------------------- requests and reports


def request_for(conn: sqlite3.Connection, edge: str, version: int) -> EvaluationRequest | None:
    """The evaluation request this manager sent ``edge`` as version ``version``."""
    row = conn.execute(
        "SELECT document FROM desired WHERE edge=? AND kind=? AND version=?",
        (edge, EVALUATE, version),
    ).fetchone()
    return None if row is None else codec.decode(str(row[0]).encode(), EvaluationRequest)


def add_report(
    conn: sqlite3.Connection,
    edge: str,
    report: EvaluationReport,
    now: float,
    *,
    foreign_items: int,
    rejected_items: int,
    dropped_reason: str,
) -> bool:
    """``edge``'s report (without its items); False if it was stored before."""
    added = conn.execute(
        "INSERT OR IGNORE INTO evaluation_reports (eval_id, edge, version, status, reason, "
        "holdout, items, reported_at, received_at, foreign_items, rejected_items, "
        "dropped_reason) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            report.eval_id,
            edge,
            report.version,
            report.status.value,
            report.reason,
            report.holdout,
            len(report.items),
            report.reported_at,
            now,
            foreign_items,
            rejected_items,
            dropped_reason,
        ),
    )
    return added.rowcount > 0


def add_items(
    conn: sqlite3.Connection,
    eval_id: str,
    edge: str,
    items: Iterable[tuple[str, EvaluationItem]],
    now: float,
) -> None:
    """The kept items of ``edge``'s report, each under its stored prediction id."""
    conn.executemany(
        "INSERT OR IGNORE INTO evaluations (eval_id, edge, prediction_id, model, label, scores, "
        "stats, at, augmented) VALUES (?,?,?,?,?,?,?,?,?)",
        [
            (
                eval_id,
                edge,
                stored_id,
                item.model,
                item.label,
                json.dumps(item.scores, sort_keys=True),
                json.dumps(item.stats, sort_keys=True),
                now,
                item.augmented or 0,
            )
            for stored_id, item in items
        ],
    )


def answered(store: Store, eval_id: str, edge: str) -> bool:
    """Whether ``edge`` reported on evaluation ``eval_id``."""
    return bool(
        store.scalar(
            "SELECT count(*) FROM evaluation_reports WHERE eval_id=? AND edge=?", (eval_id, edge)
        )
    )


def reports(store: Store, eval_id: str) -> dict[str, ReportRow]:
    """The stations that answered ``eval_id`` so far, by edge."""
    rows = store.query(
        "SELECT edge, status, reason, holdout, items, foreign_items, rejected_items, "
        "dropped_reason FROM evaluation_reports WHERE eval_id=?",
        (eval_id,),
    )
    return {str(r["edge"]): _report_row(r) for r in rows}


def _report_row(r: dict[str, Any]) -> ReportRow:
    return ReportRow(
        str(r["edge"]),
        EvaluationStatus(str(r["status"])),
        str(r["reason"]),
        int(r["holdout"]),
        int(r["items"]),
        int(r["foreign_items"]),
        int(r["rejected_items"]),
        str(r["dropped_reason"]),
    )


def scored_items(store: Store, eval_id: str, edge: str) -> tuple[Scored, ...]:
    """``edge``'s items of ``eval_id`` on the images as they are, by prediction and model."""
    return tuple(
        Scored(str(r["prediction_id"]), str(r["model"]), str(r["label"]), _scores(r))
        for r in store.query(
            # The images as they are: re-lit copies train MPP, they do not judge models.
            "SELECT prediction_id, model, label, scores FROM evaluations "
            "WHERE eval_id=? AND edge=? AND augmented = 0 ORDER BY prediction_id, model",
            (eval_id, edge),
        )
    )


def _scores(row: dict[str, Any]) -> dict[str, float]:
    try:
        data = json.loads(str(row["scores"]))
    except ValueError:
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


# ---------------------------------------------------------------- the gate's reads and verdicts


def latest_eval_id(store: Store, edge: str) -> str | None:
    """The evaluation id of ``edge``'s newest evaluation request (None: none sent)."""
    found = store.scalar(
        "SELECT json_extract(document, '$.eval_id') FROM desired WHERE edge=? AND kind=? "
        "ORDER BY version DESC LIMIT 1",
        (edge, EVALUATE),
    )
    return None if found is None else str(found)


def decided(store: Store, eval_id: str) -> bool:
    """Whether a verdict was recorded from evaluation ``eval_id``."""
    return bool(store.scalar("SELECT count(*) FROM gate_results WHERE eval_id=?", (eval_id,)))


def add_verdict(conn: sqlite3.Connection, verdict: StoredVerdict) -> None:
    conn.execute(
        "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
        "VALUES (?,?,?,?,?,?)",
        (
            verdict.name,
            verdict.version,
            int(verdict.blessed),
            json.dumps(verdict.evidence, sort_keys=True),
            verdict.eval_id,
            verdict.at,
        ),
    )


def verdict(store: Store, name: str, version: int, eval_id: str | None) -> StoredVerdict | None:
    """The newest verdict on ``name:version``, or that of evaluation ``eval_id`` if given."""
    row = store.one(
        "SELECT blessed, evidence, eval_id, at FROM gate_results WHERE name=? AND version=? "
        "AND (? IS NULL OR eval_id = ?) ORDER BY at DESC LIMIT 1",
        (name, version, eval_id, eval_id),
    )
    if row is None:
        return None
    return StoredVerdict(
        name,
        version,
        bool(row["blessed"]),
        json.loads(str(row["evidence"])),
        str(row["eval_id"]),
        float(row["at"]),
    )

"""Station evaluation reports at the manager: checked against the request, stored once.

A station answers an :class:`~fedge.protocols.evaluation.EvaluationRequest` with an
:class:`~fedge.protocols.evaluation.EvaluationReport` on its retained ``up/evaluate``
topic (or over gRPC without MQTT). The report is retained and re-stated by the agent on
every new session, so it reaches a manager that was down; storing it is idempotent: one
``evaluation_reports`` row per (evaluation, edge), one ``evaluations`` row per (image,
model, re-lit copy). A station's re-lit copies of a held-out image (``augmented`` k >= 1)
are stored under the prediction id ``<id>~k`` (``~`` is never in an identifier) with
``augmented = k``; the gate reads the images as they are only (``augmented = 0``).
A report is checked before anything is written: it must answer a request this
manager sent to that edge (same version and evaluation id) and name only the models
that request asked for; otherwise it is rejected (counted in ``rejections``) and
changes nothing. Single bad items of an answering report are dropped instead, counted
and explained in the station's evidence (``ReportRow.foreign_items``/``rejected_items``/
``dropped_reason``): an image of another station's prediction (a station evaluates its
own images only; one such item must not discard the station's answer) and scores whose
classes are not the model's.
"""

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager.gate import Scored, StationReport
from fedge.edge_manager.store import Store
from fedge.protocols import codec
from fedge.protocols.errors import ValidationError
from fedge.protocols.evaluation import (
    EvaluationItem,
    EvaluationReport,
    EvaluationRequest,
    EvaluationStatus,
)
from fedge.protocols.manifest import ModelManifest

EVALUATE = "evaluate"  # the desired-document kind (Fleet's `desired` table)


def manifest_of(envelope: str) -> ModelManifest:
    """The manifest inside a registry envelope this manager signed (not re-verified)."""
    try:
        payload = json.loads(envelope)["payload"]
        return codec.decode(str(payload).encode(), ModelManifest)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValidationError(f"unreadable manifest envelope: {exc}") from None


def request_for(conn: sqlite3.Connection, edge: str, version: int) -> EvaluationRequest | None:
    row = conn.execute(
        "SELECT document FROM desired WHERE edge=? AND kind=? AND version=?",
        (edge, EVALUATE, version),
    ).fetchone()
    return None if row is None else codec.decode(str(row[0]).encode(), EvaluationRequest)


def store_report(conn: sqlite3.Connection, edge: str, report: EvaluationReport, now: float) -> bool:
    """Store ``report`` of ``edge`` inside the caller's transaction; False if it was
    stored before (a retained copy again). Raises ValidationError, writing nothing, for a
    report that answers no request of this manager's or names models it did not ask for;
    drops (counts, explains) its items on other stations' images or with other classes."""
    request = request_for(conn, edge, report.version)
    if request is None or request.eval_id != report.eval_id:
        raise ValidationError(
            f"{edge} reports evaluation {report.eval_id!r} v{report.version}, which this "
            "manager did not ask it for"
        )
    classes = {
        manifest.ref: set(manifest.classes)
        for manifest in map(manifest_of, request.manifest_envelopes)
    }
    named = {item.model for item in report.items}
    if not named <= classes.keys():
        raise ValidationError(
            f"{edge} reports scores of {sorted(named - classes.keys())}, not of the models "
            f"asked for ({', '.join(sorted(classes))})"
        )
    foreign = set(_foreign_predictions(conn, edge, {i.prediction_id for i in report.items}))
    kept = [i for i in report.items if i.prediction_id not in foreign]
    rejected = [i for i in kept if set(i.scores) != classes[i.model]]
    kept = [i for i in kept if set(i.scores) == classes[i.model]]
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
            sum(item.prediction_id in foreign for item in report.items),
            len(rejected),
            _dropped_reason(report, foreign, rejected, classes),
        ),
    )
    if added.rowcount == 0:
        return False
    conn.executemany(
        "INSERT OR IGNORE INTO evaluations (eval_id, edge, prediction_id, model, label, scores, "
        "stats, at, augmented) VALUES (?,?,?,?,?,?,?,?,?)",
        [
            (
                report.eval_id,
                edge,
                stored_id(item.prediction_id, item.augmented),
                item.model,
                item.label,
                json.dumps(item.scores, sort_keys=True),
                json.dumps(item.stats, sort_keys=True),
                now,
                item.augmented or 0,
            )
            for item in kept
        ],
    )
    return True


def _dropped_reason(
    report: EvaluationReport,
    foreign: set[str],
    rejected: list[EvaluationItem],
    classes: dict[str, set[str]],
) -> str:
    if not foreign and not rejected:
        return ""
    foreign_items = sum(item.prediction_id in foreign for item in report.items)
    why = []
    if foreign:
        ids = sorted(foreign)
        why.append(
            f"{foreign_items} item(s) on other stations' predictions ({', '.join(ids[:3])}"
            f"{', ...' if len(ids) > 3 else ''}): a station evaluates its own images only"
        )
    if rejected:
        first = rejected[0]
        why.append(
            f"{len(rejected)} item(s) with scores not of the model's classes (e.g. "
            f"{first.prediction_id} of {first.model}: {','.join(sorted(first.scores))}, "
            f"expected {','.join(sorted(classes[first.model]))})"
        )
    return "; ".join(why)


def stored_id(prediction_id: str, augmented: int | None) -> str:
    """The ``evaluations.prediction_id`` of an item: its own id, ``<id>~k`` for copy k
    (the table's key is per image and model, and a copy is another image)."""
    return f"{prediction_id}{AUGMENTED_SEP}{augmented}" if augmented else prediction_id


AUGMENTED_SEP = "~"


def _foreign_predictions(conn: sqlite3.Connection, edge: str, ids: set[str]) -> list[str]:
    """The prediction ids among ``ids`` that another edge reported (unknown ones are not:
    the station may have scored them before retention pruned them here)."""
    ordered, foreign = sorted(ids), []
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


# -- the gate's reads


@dataclass(frozen=True)
class PendingEvaluation:
    edge: str
    eval_id: str
    candidate: str
    issued_at: float


def pending(store: Store, edges: Iterable[str]) -> list[PendingEvaluation]:
    """Per edge, its newest evaluation if it is neither answered by that edge nor
    decided (no ``gate_results`` row): a gate is, or was, waiting for it."""
    found = []
    for edge in sorted(edges):
        version = store.scalar(
            "SELECT max(version) FROM desired WHERE edge=? AND kind=?", (edge, EVALUATE)
        )
        if version is None:
            continue
        request = request_for(store.conn, edge, int(version))
        if request is None:
            continue
        answered = store.scalar(
            "SELECT count(*) FROM evaluation_reports WHERE eval_id=? AND edge=?",
            (request.eval_id, edge),
        )
        decided = store.scalar(
            "SELECT count(*) FROM gate_results WHERE eval_id=?", (request.eval_id,)
        )
        if answered or decided:
            continue
        candidate = manifest_of(request.manifest_envelopes[0]).ref  # the candidate first
        found.append(PendingEvaluation(edge, request.eval_id, candidate, request.issued_at))
    return found


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


def reports(store: Store, eval_id: str) -> dict[str, ReportRow]:
    """The stations that answered ``eval_id`` so far, by edge."""
    rows = store.query(
        "SELECT edge, status, reason, holdout, items, foreign_items, rejected_items, "
        "dropped_reason FROM evaluation_reports WHERE eval_id=?",
        (eval_id,),
    )
    return {str(r["edge"]): _report_row(r) for r in rows}


def station_report(
    store: Store, eval_id: str, edge: str, serving: str | None, row: ReportRow | None
) -> StationReport:
    """What the gate judges for ``edge``: its items, or why there are none."""
    if row is None:
        return StationReport(edge, serving, "missing", "did not answer in time")
    items = tuple(
        Scored(str(r["prediction_id"]), str(r["model"]), str(r["label"]), _scores(r))
        for r in store.query(
            # The images as they are: re-lit copies train MPP, they do not judge models.
            "SELECT prediction_id, model, label, scores FROM evaluations "
            "WHERE eval_id=? AND edge=? AND augmented = 0 ORDER BY prediction_id, model",
            (eval_id, edge),
        )
    )
    return StationReport(
        edge, serving, row.status.value, row.reason, row.holdout, items,
        row.foreign_items, row.rejected_items, row.dropped_reason,
    )  # fmt: skip


def _scores(row: dict[str, Any]) -> dict[str, float]:
    try:
        data = json.loads(str(row["scores"]))
    except ValueError:
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def manager_labels(store: Store, edge: str, prediction_ids: set[str]) -> dict[str, str]:
    """The manager's current label of each of ``edge``'s predictions that has one (a
    label of another edge's prediction never judges this station's report)."""
    labels: dict[str, str] = {}
    ids = sorted(prediction_ids)
    for start in range(0, len(ids), 500):  # SQLite's variable limit
        chunk = ids[start : start + 500]
        marks = ",".join("?" * len(chunk))
        for row in store.query(
            f"SELECT prediction_id, label FROM labels WHERE prediction_id IN ({marks}) "
            "AND edge = ?",
            (*chunk, edge),
        ):
            labels[str(row["prediction_id"])] = str(row["label"])
    return labels

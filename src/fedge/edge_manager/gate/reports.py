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

This module checks and decides; the statements are
:mod:`fedge.edge_manager.gate.store`'s.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.fleet import prediction_store
from fedge.edge_manager.gate import store as evaluation_store
from fedge.edge_manager.gate.store import ReportRow as ReportRow
from fedge.edge_manager.gate.verdict import StationReport
from fedge.edge_manager.labels import store as label_store
from fedge.edge_manager.store import Store, Transaction
from fedge.protocols import codec
from fedge.protocols.errors import ValidationError
from fedge.protocols.evaluation import EvaluationItem, EvaluationReport, EvaluationRequest
from fedge.protocols.manifest import ModelManifest

EVALUATE = evaluation_store.EVALUATE


def manifest_of(envelope: str) -> ModelManifest:
    """The manifest inside a registry envelope this manager signed (not re-verified)."""
    try:
        payload = json.loads(envelope)["payload"]
        return codec.decode(str(payload).encode(), ModelManifest)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValidationError(f"unreadable manifest envelope: {exc}") from None


def request_for(conn: Transaction, edge: str, version: int) -> EvaluationRequest | None:
    return evaluation_store.request_for(conn, edge, version)


def store_report(conn: Transaction, edge: str, report: EvaluationReport, now: float) -> bool:
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
    foreign = set(prediction_store.other_edges(conn, edge, {i.prediction_id for i in report.items}))
    kept = [i for i in report.items if i.prediction_id not in foreign]
    rejected = [i for i in kept if set(i.scores) != classes[i.model]]
    kept = [i for i in kept if set(i.scores) == classes[i.model]]
    added = evaluation_store.add_report(
        conn,
        edge,
        report,
        now,
        foreign_items=sum(item.prediction_id in foreign for item in report.items),
        rejected_items=len(rejected),
        dropped_reason=_dropped_reason(report, foreign, rejected, classes),
    )
    if not added:
        return False
    evaluation_store.add_items(
        conn,
        report.eval_id,
        edge,
        [(stored_id(item.prediction_id, item.augmented), item) for item in kept],
        now,
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
        version = desired_store.latest_version(store, edge, EVALUATE)
        if version is None:
            continue
        request = request_for(store.conn, edge, version)
        if request is None:
            continue
        answered = evaluation_store.answered(store, request.eval_id, edge)
        if answered or evaluation_store.decided(store, request.eval_id):
            continue
        candidate = manifest_of(request.manifest_envelopes[0]).ref  # the candidate first
        found.append(PendingEvaluation(edge, request.eval_id, candidate, request.issued_at))
    return found


def reports(store: Store, eval_id: str) -> dict[str, ReportRow]:
    """The stations that answered ``eval_id`` so far, by edge."""
    return evaluation_store.reports(store, eval_id)


def station_report(
    store: Store, eval_id: str, edge: str, serving: str | None, row: ReportRow | None
) -> StationReport:
    """What the gate judges for ``edge``: its items, or why there are none."""
    if row is None:
        return StationReport(edge, serving, "missing", "did not answer in time")
    items = evaluation_store.scored_items(store, eval_id, edge)
    return StationReport(
        edge, serving, row.status.value, row.reason, row.holdout, items,
        row.foreign_items, row.rejected_items, row.dropped_reason,
    )  # fmt: skip


def manager_labels(store: Store, edge: str, prediction_ids: set[str]) -> dict[str, str]:
    """The manager's current label of each of ``edge``'s predictions that has one (a
    label of another edge's prediction never judges this station's report)."""
    return label_store.current_labels(store, edge, prediction_ids)

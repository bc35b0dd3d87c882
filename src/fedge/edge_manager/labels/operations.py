"""Operators' labels on predictions, and the labels document sent down to each station.

Split out of fleet.py (one concept per module); :meth:`Fleet.add_label` calls these.
A label given here is stored (labels.py keeps the history of relabels) and the edge's
newest operator labels go down to the station as a signed ``labels`` desired document.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import prediction_store
from fedge.edge_manager.labels import current as labels
from fedge.edge_manager.labels import store as label_store
from fedge.protocols import codec, validate
from fedge.protocols.errors import ProtocolError
from fedge.protocols.labels import MAX_LABELS, MAX_WITHDRAWALS, StationLabels
from fedge.protocols.signing import MAX_ENVELOPE_BYTES

if TYPE_CHECKING:
    from fedge.edge_manager.fleet.operations import Fleet

LABELS = "labels"


def add_label(fleet: Fleet, prediction_id: str, label: str, who: str) -> tuple[str, labels.Outcome]:
    """Label a prediction, or relabel it: the new label replaces the current one, which
    goes to the label history (labels.py). The same label again changes nothing."""
    scored = prediction_store.scored_by(fleet.store, prediction_id)
    if scored is None:
        raise ManagerError(f"no prediction {prediction_id!r} has reached the manager")
    try:
        validate.identifier(label, "label")
        validate.bounded_text(who, "who", 128)
    except ProtocolError as exc:
        raise ManagerError(str(exc)) from None
    labels.check_label(fleet.store.conn, scored.model, label)
    now = time.time()
    with fleet.store.transaction() as conn:
        current = labels.current_label(conn, prediction_id)
        if current is not None and current.label == label:
            return current.label_id, labels.Outcome(labels.Applied.UNCHANGED, current)
        # A relabel must win here and on the station, which both keep the newest `at`,
        # even when the station's clock ran ahead of the manager's.
        at = now if current is None else max(now, current.at)
        new = labels.Label(
            f"l-{uuid.uuid4().hex}",
            prediction_id,
            scored.edge,
            label,
            who,
            at,
            labels.Origin.OPERATOR,
        )
        outcome = labels.apply(conn, new, now)
        push_labels(fleet, scored.edge, now)
    return new.label_id, outcome


def withdraw_label(fleet: Fleet, prediction_id: str, who: str) -> labels.Label:
    """Withdraw the current label of ``prediction_id`` given at the manager (an
    operator's undo, issue 30): it moves to the history as withdrawn, the prediction is
    unlabelled again, and the station is told in the next labels document. Returns the
    label withdrawn; a prediction without a manager-given label raises ManagerError."""
    now = time.time()
    with fleet.store.transaction() as conn:
        current = labels.current_label(conn, prediction_id)
        if current is None or current.origin is not labels.Origin.OPERATOR:
            raise ManagerError(
                f"{prediction_id} has no label given at the manager to withdraw "
                "(a label given at the station is withdrawn there); nothing was changed"
            )
        label_store.delete_current(conn, current.label_id)
        label_store.insert_history(conn, current, replaced_by=label_store.WITHDRAWN, at=now)
        push_labels(fleet, current.edge, now)
    return current


def push_labels(fleet: Fleet, edge: str, now: float) -> None:
    """The edge's labels document: the newest labels given here, down to the station.

    As many of the newest labels as fit a signed envelope the edge accepts (at most
    MAX_LABELS); older label documents of the edge are deleted, not kept forever.
    """
    records = label_store.newest_operator_labels(fleet.store, edge, MAX_LABELS)
    current = desired_store.latest_version(fleet.store, edge, LABELS)
    withdrawn = label_store.newest_withdrawals(fleet.store, edge, MAX_WITHDRAWALS)
    while True:
        document = StationLabels(
            fleet=fleet.fleet,
            edge=edge,
            version=int(current or 0) + 1,
            labels=tuple(reversed(records)),
            issued_at=now,
            withdrawn=tuple(reversed(withdrawn)) or None,
        )
        encoded = codec.encode(document)
        # Measured on the signed envelope the edge will check against its limit.
        if len(fleet.key.sign_payload(encoded)) <= MAX_ENVELOPE_BYTES or len(records) <= 1:
            break
        records = records[: max(1, len(records) * 3 // 4)]
    fleet.write_desired(edge, LABELS, document.version, encoded, now)
    # Each document holds the newest labels in full: older ones are never needed.
    label_store.delete_older_documents(fleet.store, edge, LABELS, document.version)

"""One current label per prediction at the manager; the labels it replaced, as history.

A prediction can be labelled more than once: on the station and at the manager, or by an
operator who corrects a mistake (issue 15). Counting every label made the agreement
figure wrong, so ``labels`` holds one row per prediction -- the current label -- and every
label that is no longer current moves to ``label_history`` with the label that replaced
it (``replaced_by``) and when (``replaced_at``).

The rule is the station dataset's (``party/station_store.py``): the newest ``at`` wins, a tie
going to the later arrival. The manager and the station apply it to the same records, so
they agree on the current label. A label arriving older than the current one (a station
reporting late) is kept, straight into the history. A label id seen before (in either
table) is a redelivery and changes nothing.

This module decides; :mod:`fedge.edge_manager.labels.store` holds the statements (and the
:class:`Label` dataclass). A connection passed in is the caller's open transaction.
"""

from dataclasses import dataclass
from enum import StrEnum

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.class_names import unknown_class
from fedge.edge_manager.labels import store as label_store
from fedge.edge_manager.labels.store import Label as Label
from fedge.edge_manager.labels.store import Origin as Origin
from fedge.edge_manager.store import Transaction


class Applied(StrEnum):
    LABELLED = "labelled"  # the prediction had no label
    RELABELLED = "relabelled"  # it replaced the current label
    HISTORY = "history"  # older than the current label: recorded, not current
    DUPLICATE = "duplicate"  # this label id was stored before
    UNCHANGED = "unchanged"  # an operator gave the current label again: nothing stored


@dataclass(frozen=True)
class Outcome:
    applied: Applied
    # The label it replaced (RELABELLED), lost to (HISTORY) or repeated (UNCHANGED).
    previous: Label | None = None


def replaces(new: Label, current: Label) -> bool:
    """Whether ``new`` becomes the current label instead of ``current`` (newest ``at``)."""
    return new.at >= current.at


def current_label(conn: Transaction, prediction_id: str) -> Label | None:
    return label_store.current(conn, prediction_id)


def apply(conn: Transaction, new: Label, now: float) -> Outcome:
    """Store ``new`` inside the caller's transaction under the one-current-label rule."""
    if label_store.seen(conn, new.label_id):
        return Outcome(Applied.DUPLICATE)
    current = current_label(conn, new.prediction_id)
    if current is None:
        label_store.insert_current(conn, new)
        return Outcome(Applied.LABELLED)
    if not replaces(new, current):
        label_store.insert_history(conn, new, replaced_by=current.label_id, at=now)
        return Outcome(Applied.HISTORY, current)
    label_store.delete_current(conn, current.label_id)
    label_store.insert_history(conn, current, replaced_by=new.label_id, at=now)
    label_store.insert_current(conn, new)
    return Outcome(Applied.RELABELLED, current)


def history(conn: Transaction, prediction_id: str) -> list[tuple[Label, str, float]]:
    """The labels ``prediction_id`` had before, oldest first: (label, replaced by, when)."""
    return [
        (old.label, old.replaced_by, old.replaced_at)
        for old in label_store.history(conn, prediction_id)
    ]


def check_label(conn: Transaction, model_ref: str, label: str) -> None:
    """A label must be a class of the model that made the prediction (case and all)."""
    classes = label_store.model_classes(conn, model_ref)
    if classes is None:
        return  # a model this registry never held (pruned, foreign): nothing to check
    refusal = unknown_class(label, classes, f"a class of {model_ref}, which scored it")
    if refusal is not None:
        raise ManagerError(f"{refusal}; nothing was stored")


def agreement(conn: Transaction, edge: str) -> float | None:
    """Share of ``edge``'s labelled predictions whose decision their current label agrees
    with, each prediction counted once (``None``: nothing labelled).

    A label agrees with "reject" when it names one of the model's positive (defect)
    classes, and with "accept" otherwise.
    """
    rows = label_store.labelled_decisions(conn, edge)
    if not rows:
        return None
    positives: dict[str, set[str]] = {}
    agree = 0
    for row in rows:
        if row.model not in positives:
            positives[row.model] = label_store.positive_classes(conn, row.model)
        agree += (row.decision == "reject") == (row.label in positives[row.model])
    return agree / len(rows)

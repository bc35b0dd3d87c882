"""One current label per prediction at the manager; the labels it replaced, as history.

A prediction can be labelled more than once: on the station and at the manager, or by an
operator who corrects a mistake (issue 15). Counting every label made the agreement
figure wrong, so ``labels`` holds one row per prediction -- the current label -- and every
label that is no longer current moves to ``label_history`` with the label that replaced
it (``replaced_by``) and when (``replaced_at``).

The rule is the station dataset's (``party/dataset.py``): the newest ``at`` wins, a tie
going to the later arrival. The manager and the station apply it to the same records, so
they agree on the current label. A label arriving older than the current one (a station
reporting late) is kept, straight into the history. A label id seen before (in either
table) is a redelivery and changes nothing.
"""

import json
import sqlite3
from dataclasses import dataclass
from enum import StrEnum

from fedge.edge_manager.class_names import unknown_class
from fedge.edge_manager.errors import ManagerError
from fedge.protocols.records import LabelRecord

_COLUMNS = "label_id, prediction_id, edge, label, who, at, origin"


class Origin(StrEnum):
    OPERATOR = "operator"  # given at the manager (`fedge labels add`)
    EDGE = "edge"  # given on the station and reported up


@dataclass(frozen=True)
class Label:
    label_id: str
    prediction_id: str
    edge: str
    label: str
    who: str
    at: float
    origin: Origin

    @classmethod
    def reported(cls, record: LabelRecord, edge: str) -> "Label":
        """A label a station reported up."""
        return cls(
            record.label_id, record.prediction_id, edge, record.label, record.who, record.at,
            Origin.EDGE,
        )  # fmt: skip


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


def current_label(conn: sqlite3.Connection, prediction_id: str) -> Label | None:
    row = conn.execute(
        f"SELECT {_COLUMNS} FROM labels WHERE prediction_id=?", (prediction_id,)
    ).fetchone()
    return None if row is None else _label(row)


def apply(conn: sqlite3.Connection, new: Label, now: float) -> Outcome:
    """Store ``new`` inside the caller's transaction under the one-current-label rule."""
    seen = conn.execute(
        "SELECT 1 FROM labels WHERE label_id=? UNION ALL "
        "SELECT 1 FROM label_history WHERE label_id=?",
        (new.label_id, new.label_id),
    ).fetchone()
    if seen is not None:
        return Outcome(Applied.DUPLICATE)
    current = current_label(conn, new.prediction_id)
    if current is None:
        _insert(conn, "labels", new)
        return Outcome(Applied.LABELLED)
    if not replaces(new, current):
        _to_history(conn, new, replaced_by=current.label_id, at=now)
        return Outcome(Applied.HISTORY, current)
    conn.execute("DELETE FROM labels WHERE label_id=?", (current.label_id,))
    _to_history(conn, current, replaced_by=new.label_id, at=now)
    _insert(conn, "labels", new)
    return Outcome(Applied.RELABELLED, current)


def history(conn: sqlite3.Connection, prediction_id: str) -> list[tuple[Label, str, float]]:
    """The labels ``prediction_id`` had before, oldest first: (label, replaced by, when)."""
    rows = conn.execute(
        f"SELECT {_COLUMNS}, replaced_by, replaced_at FROM label_history "
        "WHERE prediction_id=? ORDER BY at, label_id",
        (prediction_id,),
    ).fetchall()
    return [(_label(row[:7]), str(row[7]), float(row[8])) for row in rows]


def check_label(conn: sqlite3.Connection, model_ref: str, label: str) -> None:
    """A label must be a class of the model that made the prediction (case and all)."""
    name, _, version = model_ref.rpartition(":")
    row = conn.execute(
        "SELECT manifest FROM models WHERE name=? AND version=?",
        (name, int(version) if version.isdigit() else -1),
    ).fetchone()
    if row is None:
        return  # a model this registry never held (pruned, foreign): nothing to check
    classes = json.loads(row[0])["classes"]
    refusal = unknown_class(label, classes, f"a class of {model_ref}, which scored it")
    if refusal is not None:
        raise ManagerError(f"{refusal}; nothing was stored")


def agreement(conn: sqlite3.Connection, edge: str) -> float | None:
    """Share of ``edge``'s labelled predictions whose decision their current label agrees
    with, each prediction counted once (``None``: nothing labelled).

    A label agrees with "reject" when it names one of the model's positive (defect)
    classes, and with "accept" otherwise.
    """
    # A prediction id is not a key of `predictions`: GROUP BY counts one should it repeat.
    rows = conn.execute(
        "SELECT p.model, p.decision, l.label FROM labels l JOIN (SELECT prediction_id, model, "
        "decision FROM predictions WHERE edge=? GROUP BY prediction_id) p "
        "ON p.prediction_id = l.prediction_id",
        (edge,),
    ).fetchall()
    if not rows:
        return None
    positives: dict[str, set[str]] = {}
    agree = 0
    for model, decision, label in rows:
        if model not in positives:
            positives[model] = _positive_classes(conn, str(model))
        agree += (decision == "reject") == (label in positives[model])
    return agree / len(rows)


def _positive_classes(conn: sqlite3.Connection, ref: str) -> set[str]:
    name, _, version = ref.rpartition(":")
    row = conn.execute(
        "SELECT manifest FROM models WHERE name=? AND version=?",
        (name, int(version) if version.isdigit() else -1),
    ).fetchone()
    return set() if row is None else set(json.loads(row[0])["positive_classes"])


def _insert(conn: sqlite3.Connection, table: str, label: Label) -> None:
    conn.execute(
        f"INSERT INTO {table} ({_COLUMNS}) VALUES (?,?,?,?,?,?,?)",
        (
            label.label_id,
            label.prediction_id,
            label.edge,
            label.label,
            label.who,
            label.at,
            label.origin.value,
        ),
    )


def _to_history(conn: sqlite3.Connection, label: Label, replaced_by: str, at: float) -> None:
    conn.execute(
        f"INSERT OR IGNORE INTO label_history ({_COLUMNS}, replaced_by, replaced_at) "
        "VALUES (?,?,?,?,?,?,?,?,?)",
        (
            label.label_id,
            label.prediction_id,
            label.edge,
            label.label,
            label.who,
            label.at,
            label.origin.value,
            replaced_by,
            at,
        ),
    )


def _label(row: tuple[object, ...]) -> Label:
    label_id, prediction_id, edge, label, who, at, origin = row
    return Label(
        str(label_id),
        str(prediction_id),
        str(edge),
        str(label),
        str(who),
        float(str(at)),
        Origin(str(origin)),
    )

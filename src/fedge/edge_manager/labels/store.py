"""Labels in the manager's store: the current label of each prediction, the label history,
and the labels document pushed down to a station -- the SQL side of labels.

:mod:`fedge.edge_manager.labels.current` decides (the one-current-label rule, agreement) and
:mod:`fedge.edge_manager.labels.operations` takes operators' labels; both call these. The
writes take the connection of a transaction the caller opened (ingest's, or the
operator's), so a label and what it replaces are stored together or not at all.
"""

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from fedge.edge_manager.store import Store
from fedge.protocols.labels import Withdrawal
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


@dataclass(frozen=True)
class ReplacedLabel:
    """A label that is no longer current: the label that replaced it, and when."""

    label: Label
    replaced_by: str
    replaced_at: float


@dataclass(frozen=True)
class LabelledDecision:
    """A labelled prediction of an edge: the model that scored it, its decision, and its
    current label."""

    model: str
    decision: str
    label: str


# ---------------------------------------------------------------- current labels and history


def seen(conn: sqlite3.Connection, label_id: str) -> bool:
    """Whether ``label_id`` was stored before, as a current label or in the history."""
    row = conn.execute(
        "SELECT 1 FROM labels WHERE label_id=? UNION ALL "
        "SELECT 1 FROM label_history WHERE label_id=?",
        (label_id, label_id),
    ).fetchone()
    return row is not None


def current(conn: sqlite3.Connection, prediction_id: str) -> Label | None:
    """The current label of ``prediction_id`` (None: it has none)."""
    row = conn.execute(
        f"SELECT {_COLUMNS} FROM labels WHERE prediction_id=?", (prediction_id,)
    ).fetchone()
    return None if row is None else _label(row)


def insert_current(conn: sqlite3.Connection, label: Label) -> None:
    """``label`` as its prediction's current label (the prediction has none now)."""
    conn.execute(f"INSERT INTO labels ({_COLUMNS}) VALUES (?,?,?,?,?,?,?)", _values(label))


def delete_current(conn: sqlite3.Connection, label_id: str) -> None:
    conn.execute("DELETE FROM labels WHERE label_id=?", (label_id,))


def insert_history(conn: sqlite3.Connection, label: Label, replaced_by: str, at: float) -> None:
    """``label`` into the history, replaced by ``replaced_by`` at ``at`` (once per id)."""
    conn.execute(
        f"INSERT OR IGNORE INTO label_history ({_COLUMNS}, replaced_by, replaced_at) "
        "VALUES (?,?,?,?,?,?,?,?,?)",
        (*_values(label), replaced_by, at),
    )


def history(conn: sqlite3.Connection, prediction_id: str) -> list[ReplacedLabel]:
    """The labels ``prediction_id`` had before, oldest first."""
    rows = conn.execute(
        f"SELECT {_COLUMNS}, replaced_by, replaced_at FROM label_history "
        "WHERE prediction_id=? ORDER BY at, label_id",
        (prediction_id,),
    ).fetchall()
    return [ReplacedLabel(_label(row[:7]), str(row[7]), float(row[8])) for row in rows]


def current_labels(store: Store, edge: str, prediction_ids: Iterable[str]) -> dict[str, str]:
    """The current label of each of ``edge``'s predictions among ``prediction_ids`` that
    has one, by prediction id."""
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


def labelled_edges(store: Store) -> set[str]:
    """The edges with at least one labelled prediction."""
    return {str(r["edge"]) for r in store.query("SELECT DISTINCT edge FROM labels")}


def labelled_decisions(conn: sqlite3.Connection, edge: str) -> list[LabelledDecision]:
    """``edge``'s labelled predictions, each prediction once."""
    # A prediction id is not a key of `predictions`: GROUP BY counts one should it repeat.
    rows = conn.execute(
        "SELECT p.model, p.decision, l.label FROM labels l JOIN (SELECT prediction_id, model, "
        "decision FROM predictions WHERE edge=? GROUP BY prediction_id) p "
        "ON p.prediction_id = l.prediction_id",
        (edge,),
    ).fetchall()
    return [
        LabelledDecision(str(model), str(decision), str(label)) for model, decision, label in rows
    ]


# ---------------------------------------------------------------- the models' classes


def model_classes(conn: sqlite3.Connection, model_ref: str) -> list[str] | None:
    """The classes of registry model ``model_ref`` (NAME:VERSION); None: not in it."""
    manifest = _manifest(conn, model_ref)
    return None if manifest is None else list(json.loads(manifest)["classes"])


def positive_classes(conn: sqlite3.Connection, model_ref: str) -> set[str]:
    """The positive (defect) classes of ``model_ref``; none for a model not in the registry."""
    manifest = _manifest(conn, model_ref)
    return set() if manifest is None else set(json.loads(manifest)["positive_classes"])


def _manifest(conn: sqlite3.Connection, model_ref: str) -> str | None:
    name, _, version = model_ref.rpartition(":")
    row = conn.execute(
        "SELECT manifest FROM models WHERE name=? AND version=?",
        (name, int(version) if version.isdigit() else -1),
    ).fetchone()
    return None if row is None else str(row[0])


# ---------------------------------------------------------------- the labels document


def newest_operator_labels(store: Store, edge: str, limit: int) -> list[LabelRecord]:
    """The newest ``limit`` labels given at the manager on ``edge``'s predictions, newest
    first, as the labels document carries them."""
    rows = store.query(
        "SELECT label_id, prediction_id, label, who, at FROM labels "
        "WHERE edge=? AND origin='operator' ORDER BY at DESC, label_id LIMIT ?",
        (edge, limit),
    )
    return [
        LabelRecord(r["label_id"], r["prediction_id"], r["label"], r["who"], r["at"]) for r in rows
    ]


WITHDRAWN = "withdrawn"  # label_history.replaced_by of a label an operator withdrew


def newest_withdrawals(store: Store, edge: str, limit: int) -> list[Withdrawal]:
    """The newest ``limit`` withdrawals of ``edge``'s operator labels, newest first."""
    rows = store.query(
        "SELECT label_id, prediction_id, at FROM label_history WHERE edge=? AND "
        "replaced_by=? AND origin='operator' ORDER BY replaced_at DESC, label_id LIMIT ?",
        (edge, WITHDRAWN, limit),
    )
    return [Withdrawal(r["label_id"], r["prediction_id"], r["at"]) for r in rows]


def delete_older_documents(store: Store, edge: str, kind: str, version: int) -> None:
    """Delete ``edge``'s desired documents of ``kind`` older than ``version``."""
    store.conn.execute(
        "DELETE FROM desired WHERE edge=? AND kind=? AND version < ?", (edge, kind, version)
    )


def _values(label: Label) -> tuple[str, str, str, str, str, float, str]:
    return (
        label.label_id,
        label.prediction_id,
        label.edge,
        label.label,
        label.who,
        label.at,
        label.origin.value,
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

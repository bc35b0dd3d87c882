"""Alerts and label-free estimates in the manager's store: the SQLite side of the monitor.

Writers (the monitor in ``serve``'s worker thread, ``fedge alerts clear``) and readers
(``fedge alerts``, later the console) meet here; no sqlite row leaves this module.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.monitor.rules import Estimate, OpenAlert
from fedge.edge_manager.store import Store
from fedge.protocols import validate
from fedge.protocols.alerts import Alert, AlertKind, AlertState
from fedge.protocols.errors import ValidationError

MONITOR = "monitor"
"""``cleared_by`` of an alert the monitor cleared (its condition no longer holds)."""


class UnknownAlertError(ManagerError):
    pass


@dataclass(frozen=True)
class StoredEstimate(Estimate):
    """One edge's label-free estimate of one model over one window, as ``fedge alerts
    estimates`` shows it."""

    edge: str
    model: str


@dataclass(frozen=True)
class AlertView:
    alert_id: str
    edge: str
    model: str
    kind: str
    value: float
    threshold: float
    detail: dict[str, Any]
    raised_at: float
    cleared_at: float | None
    cleared_by: str  # "" while open; "monitor", or the operator who acknowledged it
    note: str = ""

    @property
    def is_open(self) -> bool:
        return self.cleared_at is None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "open": self.is_open}

    def message(self, fleet: str) -> Alert:
        """The alert as published on the alerts topic."""
        return Alert(
            alert_id=self.alert_id,
            fleet=fleet,
            edge=self.edge,
            model=self.model,
            condition=AlertKind(self.kind),
            state=AlertState.RAISED if self.is_open else AlertState.CLEARED,
            value=self.value,
            threshold=self.threshold,
            detail=json.dumps(self.detail, sort_keys=True),
            raised_at=self.raised_at,
            cleared_at=self.cleared_at,
            cleared_by=self.cleared_by,
        )


_SELECT = (
    "SELECT a.alert_id, a.edge, a.model, a.kind, a.value, a.threshold, a.detail, a.raised_at, "
    "a.cleared_at, k.who, k.note FROM alerts a LEFT JOIN alert_acks k ON k.alert_id = a.alert_id"
)


def _view(row: dict[str, Any]) -> AlertView:
    cleared_at = row["cleared_at"]
    who = row["who"]
    return AlertView(
        alert_id=str(row["alert_id"]),
        edge=str(row["edge"]),
        model=str(row["model"]),
        kind=str(row["kind"]),
        value=float(row["value"]),
        threshold=float(row["threshold"]),
        detail=json.loads(row["detail"]),
        raised_at=float(row["raised_at"]),
        cleared_at=None if cleared_at is None else float(cleared_at),
        cleared_by="" if cleared_at is None else (MONITOR if who is None else str(who)),
        note="" if row["note"] is None else str(row["note"]),
    )


# ---------------------------------------------------------------- reading


def list_alerts(
    store: Store,
    *,
    edge: str | None = None,
    include_cleared: bool = False,
    limit: int = 200,
    model: str | None = None,
    raised_from: float | None = None,
    raised_until: float | None = None,
) -> list[AlertView]:
    """Alerts, newest first: the open ones, or all with ``include_cleared``; of one edge,
    one model, raised in [``raised_from``, ``raised_until``] when given."""
    where: list[str] = []
    params: list[Any] = []
    for clause, value in (
        ("a.edge = ?", edge),
        ("a.model = ?", model),
        ("a.raised_at >= ?", raised_from),
        ("a.raised_at <= ?", raised_until),
    ):
        if value is not None:
            where.append(clause)
            params.append(value)
    if not include_cleared:
        where.append("a.cleared_at IS NULL")
    sql = _SELECT + (" WHERE " + " AND ".join(where) if where else "")
    sql += " ORDER BY a.raised_at DESC, a.rowid DESC LIMIT ?"
    return [_view(row) for row in store.query(sql, (*params, max(1, limit)))]


def get_alert(store: Store, alert_id: str) -> AlertView:
    row = store.one(_SELECT + " WHERE a.alert_id = ?", (alert_id,))
    if row is None:
        raise UnknownAlertError(f"no alert {alert_id!r}; list them with `fedge alerts --all`")
    return _view(row)


def open_alerts(store: Store, edge: str, model: str) -> dict[AlertKind, OpenAlert]:
    rows = store.query(
        "SELECT alert_id, kind, raised_at FROM alerts WHERE edge=? AND model=? "
        "AND cleared_at IS NULL ORDER BY raised_at",
        (edge, model),
    )
    return {
        AlertKind(r["kind"]): OpenAlert(str(r["alert_id"]), AlertKind(r["kind"]), r["raised_at"])
        for r in rows
        if r["kind"] in AlertKind.__members__.values()
    }


def open_pairs(store: Store) -> list[tuple[str, str, OpenAlert]]:
    """(edge, model, alert) of every open alert (through the ``alerts_open`` index)."""
    rows = store.query(
        "SELECT alert_id, edge, model, kind, raised_at FROM alerts WHERE cleared_at IS NULL"
    )
    return [
        (
            str(r["edge"]),
            str(r["model"]),
            OpenAlert(str(r["alert_id"]), AlertKind(r["kind"]), r["raised_at"]),
        )
        for r in rows
        if r["kind"] in AlertKind.__members__.values()
    ]


def acknowledged(store: Store, edge: str, model: str) -> frozenset[AlertKind]:
    """Kinds an operator acknowledged that have not stopped holding since (not re-armed)."""
    rows = store.query(
        "SELECT DISTINCT kind FROM alert_acks WHERE edge=? AND model=? AND rearmed_at IS NULL",
        (edge, model),
    )
    return frozenset(
        AlertKind(r["kind"]) for r in rows if r["kind"] in AlertKind.__members__.values()
    )


def unpublished_acks(store: Store) -> list[AlertView]:
    """Operators' clearings serve has not announced yet (oldest first). From the
    acknowledgements' side, so the partial index ``alert_acks_unpublished`` bounds it."""
    rows = store.query(
        "SELECT a.alert_id, a.edge, a.model, a.kind, a.value, a.threshold, a.detail, "
        "a.raised_at, a.cleared_at, k.who, k.note FROM alert_acks k "
        "JOIN alerts a ON a.alert_id = k.alert_id "
        "WHERE k.published_at IS NULL AND a.cleared_at IS NOT NULL ORDER BY k.at"
    )
    return [_view(row) for row in rows]


def list_estimates(
    store: Store, *, edge: str | None = None, model: str | None = None, limit: int = 50
) -> list[StoredEstimate]:
    """Label-free accuracy per window, newest first (rows of the ``estimates`` table)."""
    where, params = [], []
    for column, value in (("edge", edge), ("model", model)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    sql = (
        "SELECT edge, model, window_start, window_end, n, mpp, calibration, labelled, "
        "true_accuracy, rejects, input_drift, score_drift FROM estimates"
        + (" WHERE " + " AND ".join(where) if where else "")
    )
    sql += " ORDER BY window_end DESC LIMIT ?"
    return [StoredEstimate(**row) for row in store.query(sql, (*params, max(1, limit)))]


# ---------------------------------------------------------------- writing


def new_alert_id() -> str:
    return f"a-{uuid.uuid4().hex[:12]}"  # short: people type it into `fedge alerts clear`


def insert_alert(conn: sqlite3.Connection, view: AlertView) -> None:
    conn.execute(
        "INSERT INTO alerts (alert_id, edge, model, kind, value, threshold, detail, raised_at, "
        "cleared_at) VALUES (?,?,?,?,?,?,?,?,NULL)",
        (
            view.alert_id,
            view.edge,
            view.model,
            view.kind,
            view.value,
            view.threshold,
            json.dumps(view.detail, sort_keys=True),
            view.raised_at,
        ),
    )


def clear_alert(conn: sqlite3.Connection, alert_id: str, at: float) -> bool:
    """Clear an open alert; False if it was already cleared (by an operator, meanwhile)."""
    cursor = conn.execute(
        "UPDATE alerts SET cleared_at=? WHERE alert_id=? AND cleared_at IS NULL", (at, alert_id)
    )
    return cursor.rowcount > 0


def rearm(conn: sqlite3.Connection, edge: str, model: str, kind: AlertKind, at: float) -> None:
    conn.execute(
        "UPDATE alert_acks SET rearmed_at=? WHERE edge=? AND model=? AND kind=? "
        "AND rearmed_at IS NULL",
        (at, edge, model, kind.value),
    )


def mark_ack_published(conn: sqlite3.Connection, alert_id: str, at: float) -> None:
    """Serve announced an operator's clearing: call only once the publish was accepted."""
    conn.execute("UPDATE alert_acks SET published_at=? WHERE alert_id=?", (at, alert_id))


def last_estimate_end(store: Store, edge: str, model: str) -> float:
    """The end of the newest window recorded for (edge, model), or -inf."""
    value = store.scalar(
        "SELECT max(window_end) FROM estimates WHERE edge=? AND model=?", (edge, model)
    )
    return float("-inf") if value is None else float(value)


def write_estimate(conn: sqlite3.Connection, edge: str, model: str, result: Estimate) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO estimates (edge, model, window_start, window_end, n, mpp, "
        "calibration, labelled, true_accuracy, rejects, input_drift, score_drift) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            edge,
            model,
            result.window_start,
            result.window_end,
            result.n,
            result.mpp,
            result.calibration,
            result.labelled,
            result.true_accuracy,
            result.rejects,
            result.input_drift,
            result.score_drift,
        ),
    )


def acknowledge(store: Store, alert_id: str, who: str, note: str, now: float) -> AlertView:
    """An operator acknowledges (clears) an open alert; recorded with who and why.

    The condition is not raised again for that edge and model until it has stopped
    holding once; ``serve`` publishes the clearing on the alerts topic.
    """
    try:
        validate.bounded_text(who, "who", 128)
        validate.bounded_text(note, "note", 500)
    except ValidationError as exc:
        raise ManagerError(str(exc)) from None
    if not who.strip():
        raise ManagerError("who must name the operator acknowledging the alert")
    with store.transaction() as conn:
        row = conn.execute(
            "SELECT edge, model, kind, cleared_at FROM alerts WHERE alert_id=?", (alert_id,)
        ).fetchone()
        if row is None:
            raise UnknownAlertError(f"no alert {alert_id!r}; list them with `fedge alerts --all`")
        if row[3] is not None:
            raise ManagerError(
                f"alert {alert_id} was already cleared; nothing was changed "
                "(see it with `fedge alerts --all`)"
            )
        conn.execute("UPDATE alerts SET cleared_at=? WHERE alert_id=?", (now, alert_id))
        conn.execute(
            "INSERT INTO alert_acks (alert_id, edge, model, kind, who, note, at) "
            "VALUES (?,?,?,?,?,?,?)",
            (alert_id, row[0], row[1], row[2], who, note, now),
        )
    return get_alert(store, alert_id)

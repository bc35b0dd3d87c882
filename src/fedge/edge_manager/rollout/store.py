"""Staged rollouts in the manager's store: the SQL side of the rollouts tables.

The rollout modules decide (rollouts.py starts and steps rollouts, rollout_writes.py
carries a step out, rollout_guard.py refuses changes to held edges, rollout_views.py
shows them); this module holds their statements over ``rollouts``, ``rollout_edges``
and ``rollout_events``, and the few reads they make of the rest of the store (the gate's
verdict and evidence, what an edge serves, whether a model is published). Every function
takes the connection, so a write joins the transaction its caller opened. The health
figures of moved edges are read in rollout_health_store.py.
"""

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from fedge.edge_manager.rollout.machine import RolloutEdge


@dataclass(frozen=True)
class RolloutRow:
    """One ``rollouts`` row (``plan``: RolloutPlan JSON; ``wave`` -1: none moved yet)."""

    rollout_id: str
    model_name: str
    model_version: int
    plan: str
    state: str
    wave: int
    forced_unblessed: int
    reason: str
    created_at: float
    updated_at: float
    finished_at: float | None


@dataclass(frozen=True)
class RolloutSummary:
    """One line of ``fedge rollout list``: ``edges`` in the rollout, ``moved`` of them
    no longer waiting."""

    rollout_id: str
    model: str
    state: str
    wave: int
    created_at: float
    updated_at: float
    finished_at: float | None
    reason: str
    forced_unblessed: bool
    edges: int
    moved: int
    anomaly: str | None  # the anomaly model the rollout carries beside it (issue 28)


@dataclass(frozen=True)
class RolloutEvent:
    at: float
    kind: str
    edge: str
    detail: str


_ROLLOUT_COLUMNS = (
    "rollout_id, model_name, model_version, plan, state, wave, forced_unblessed, reason, "
    "created_at, updated_at, finished_at"
)

# -- the gate's verdict, and what a rollout reads of edges and models


def gate_blessed(conn: sqlite3.Connection, name: str, version: int) -> bool | None:
    """The gate's newest verdict on ``name:version`` (None: never gated)."""
    row = conn.execute(
        "SELECT blessed FROM gate_results WHERE name=? AND version=? ORDER BY at DESC LIMIT 1",
        (name, version),
    ).fetchone()
    return None if row is None else bool(row[0])


def gate_evidence(conn: sqlite3.Connection, name: str, version: int) -> str | None:
    """The JSON evidence of the gate's newest verdict on ``name:version`` (None: never gated)."""
    row = conn.execute(
        "SELECT evidence FROM gate_results WHERE name=? AND version=? ORDER BY at DESC LIMIT 1",
        (name, version),
    ).fetchone()
    return None if row is None else str(row[0])


def is_published(conn: sqlite3.Connection, name: str, version: int) -> bool:
    """Whether the registry holds ``name:version``."""
    row = conn.execute(
        "SELECT 1 FROM models WHERE name=? AND version=?", (name, version)
    ).fetchone()
    return row is not None


# -- rollouts: created, read, stepped


def insert_rollout(
    conn: sqlite3.Connection,
    *,
    rollout_id: str,
    name: str,
    version: int,
    plan: str,
    state: str,
    wave: int,
    forced_unblessed: bool,
    reason: str,
    now: float,
    edges: Sequence[RolloutEdge],
) -> None:
    """A new rollout and its edges (in the caller's transaction)."""
    conn.execute(
        "INSERT INTO rollouts (rollout_id, model_name, model_version, plan, state, wave, "
        "forced_unblessed, reason, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
        (rollout_id, name, version, plan, state, wave, int(forced_unblessed), reason, now, now),
    )
    conn.executemany(
        "INSERT INTO rollout_edges (rollout_id, edge, wave, state) VALUES (?,?,?,?)",
        [(rollout_id, e.edge, e.wave, e.state.value) for e in edges],
    )


def rollout_row(conn: sqlite3.Connection, rollout_id: str) -> RolloutRow | None:
    row = conn.execute(
        f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id=?", (rollout_id,)
    ).fetchone()
    return None if row is None else RolloutRow(*row)


def unfinished_ids(conn: sqlite3.Connection) -> list[str]:
    """The rollouts not finished yet, oldest first."""
    rows = conn.execute(
        "SELECT rollout_id FROM rollouts WHERE finished_at IS NULL ORDER BY created_at"
    ).fetchall()
    return [str(r[0]) for r in rows]


def newest_id(conn: sqlite3.Connection) -> str | None:
    row = conn.execute(
        "SELECT rollout_id FROM rollouts ORDER BY created_at DESC LIMIT 1"
    ).fetchone()
    return None if row is None else str(row[0])


def newest_of_model(conn: sqlite3.Connection, name: str, version: int) -> str | None:
    """The newest rollout of ``name:version`` (None: it was never rolled out)."""
    row = conn.execute(
        "SELECT rollout_id FROM rollouts WHERE model_name=? AND model_version=? "
        "ORDER BY created_at DESC LIMIT 1",
        (name, version),
    ).fetchone()
    return None if row is None else str(row[0])


def summaries(conn: sqlite3.Connection) -> list[RolloutSummary]:
    """Every rollout, newest first, with its edge counts."""
    rows = conn.execute(
        "SELECT r.rollout_id, r.model_name || ':' || r.model_version AS model, r.state, r.wave, "
        "r.created_at, r.updated_at, r.finished_at, r.reason, r.forced_unblessed, "
        "(SELECT count(*) FROM rollout_edges e WHERE e.rollout_id=r.rollout_id) AS edges, "
        "(SELECT count(*) FROM rollout_edges e WHERE e.rollout_id=r.rollout_id "
        " AND e.state != 'waiting') AS moved, r.plan "
        "FROM rollouts r ORDER BY r.created_at DESC, r.rollout_id"
    ).fetchall()
    summaries = []
    for rid, model, state, wave, created, updated, finished, reason, forced, n, moved, plan in rows:
        anomaly = _plan_anomaly(plan)
        summary = (rid, model, state, wave, created, updated, finished, reason, bool(forced))
        summaries.append(RolloutSummary(*summary, n, moved, anomaly))
    return summaries


def _plan_anomaly(plan: str) -> str | None:
    """The anomaly model a stored plan names (None: none, or a plan that is damaged,
    which loading the rollout reports)."""
    try:
        anomaly = json.loads(plan).get("anomaly")
    except (ValueError, AttributeError):
        return None
    return anomaly if isinstance(anomaly, str) else None


def set_halted(
    conn: sqlite3.Connection, rollout_id: str, state: str, reason: str, now: float
) -> None:
    conn.execute(
        "UPDATE rollouts SET state=?, reason=?, updated_at=? WHERE rollout_id=?",
        (state, reason, now, rollout_id),
    )


def set_stepped(
    conn: sqlite3.Connection,
    rollout_id: str,
    *,
    state: str,
    wave: int,
    reason: str | None,
    finished_at: float | None,
    now: float,
) -> None:
    """A step's new state and wave; ``reason`` None keeps the stored one."""
    conn.execute(
        "UPDATE rollouts SET state=?, wave=?, updated_at=?, reason=coalesce(?, reason), "
        "finished_at=? WHERE rollout_id=?",
        (state, wave, now, reason, finished_at, rollout_id),
    )


# -- a rollout's edges


@dataclass(frozen=True)
class RolloutEdgeRow:
    """One edge of a rollout as stored: its wave and state, what it ran before the
    rollout moved it (model, config document), the deployment and config version that
    moved it, and those that sent it back."""

    rollout_id: str
    edge: str
    wave: int
    state: str
    previous_model: str | None
    previous_config: str | None
    moved_at: float | None
    deployment_id: str | None
    config_version: int | None
    restore_deployment_id: str | None
    restore_config_version: int | None
    restored_at: float | None
    # The anomaly model it served beside ``previous_model`` (None: none; issue 28).
    previous_anomaly: str | None = None


def edge_rows(conn: sqlite3.Connection, rollout_id: str) -> dict[str, RolloutEdgeRow]:
    """The edges of ``rollout_id`` by edge, by wave then edge (rollout_writes.Loaded.rows)."""
    rows = conn.execute(
        "SELECT rollout_id, edge, wave, state, previous_model, previous_config, moved_at, "
        "deployment_id, config_version, restore_deployment_id, restore_config_version, "
        "restored_at, previous_anomaly FROM rollout_edges WHERE rollout_id=? "
        "ORDER BY wave, edge",
        (rollout_id,),
    ).fetchall()
    return {str(row[1]): RolloutEdgeRow(*row) for row in rows}


def unfinished_rollouts_of(conn: sqlite3.Connection, edges: list[str]) -> dict[str, str]:
    """edge -> id of the unfinished rollout it belongs to, for ``edges``."""
    if not edges:  # `IN ()` is no statement
        return {}
    marks = ",".join("?" * len(edges))
    rows = conn.execute(
        f"SELECT e.edge, r.rollout_id FROM rollout_edges e JOIN rollouts r "
        f"ON r.rollout_id = e.rollout_id WHERE r.finished_at IS NULL AND e.edge IN ({marks})",
        tuple(edges),
    ).fetchall()
    return {str(edge): str(rid) for edge, rid in rows}


def set_edge_moved(
    conn: sqlite3.Connection,
    rollout_id: str,
    edge: str,
    *,
    state: str,
    previous_model: str | None,
    previous_config: str | None,
    moved_at: float,
    deployment_id: str,
    config_version: int,
    previous_anomaly: str | None = None,
) -> None:
    """An edge moved to the rollout's model: what it ran before (model, the anomaly model
    beside it, config), what was written for it."""
    conn.execute(
        "UPDATE rollout_edges SET state=?, previous_model=?, previous_anomaly=?, "
        "previous_config=?, moved_at=?, deployment_id=?, config_version=? "
        "WHERE rollout_id=? AND edge=?",
        (
            state,
            previous_model,
            previous_anomaly,
            previous_config,
            moved_at,
            deployment_id,
            config_version,
            rollout_id,
            edge,
        ),
    )


def set_edge_sent_back(
    conn: sqlite3.Connection,
    rollout_id: str,
    edge: str,
    *,
    state: str,
    deployment_id: str | None,
    config_version: int,
) -> None:
    """An edge sent back to its previous model: the deployment and config written for it."""
    conn.execute(
        "UPDATE rollout_edges SET state=?, restore_deployment_id=?, restore_config_version=? "
        "WHERE rollout_id=? AND edge=?",
        (state, deployment_id, config_version, rollout_id, edge),
    )


def set_edge_restored(
    conn: sqlite3.Connection, rollout_id: str, edge: str, state: str, at: float
) -> None:
    conn.execute(
        "UPDATE rollout_edges SET state=?, restored_at=? WHERE rollout_id=? AND edge=?",
        (state, at, rollout_id, edge),
    )


def set_edge_state(conn: sqlite3.Connection, rollout_id: str, edge: str, state: str) -> None:
    conn.execute(
        "UPDATE rollout_edges SET state=? WHERE rollout_id=? AND edge=?",
        (state, rollout_id, edge),
    )


# -- a rollout's events


def record_event(
    conn: sqlite3.Connection, rollout_id: str, at: float, kind: str, edge: str, detail: str
) -> None:
    conn.execute(
        "INSERT INTO rollout_events (rollout_id, at, kind, edge, detail) VALUES (?,?,?,?,?)",
        (rollout_id, at, kind, edge, detail),
    )


def last_event_at(conn: sqlite3.Connection, rollout_id: str, kind: str) -> float | None:
    """When ``rollout_id`` last recorded an event of ``kind`` (None: never)."""
    value = conn.execute(
        "SELECT max(at) FROM rollout_events WHERE rollout_id=? AND kind=?", (rollout_id, kind)
    ).fetchone()[0]
    return None if value is None else float(value)


def events(conn: sqlite3.Connection, rollout_id: str) -> list[RolloutEvent]:
    """``rollout_id``'s events, oldest first (in the order recorded within an instant)."""
    rows = conn.execute(
        "SELECT at, kind, edge, detail FROM rollout_events WHERE rollout_id=? ORDER BY at, rowid",
        (rollout_id,),
    ).fetchall()
    return [RolloutEvent(*row) for row in rows]

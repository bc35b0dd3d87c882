"""Staged rollouts as operators see them: plain dicts for the CLI, JSON and the console."""

import sqlite3
from typing import Any

from fedge.edge_manager import rollout_health as health
from fedge.edge_manager.rollout import EdgeState, RolloutState
from fedge.edge_manager.rollout_writes import load
from fedge.edge_manager.store import Store


def list_rollouts(store: Store) -> list[dict[str, Any]]:
    """Every rollout, newest first: id, model, state (``wave 2``...), edge counts."""
    rows = store.query(
        "SELECT r.rollout_id, r.model_name || ':' || r.model_version AS model, r.state, r.wave, "
        "r.created_at, r.updated_at, r.finished_at, r.reason, r.forced_unblessed, "
        "(SELECT count(*) FROM rollout_edges e WHERE e.rollout_id=r.rollout_id) AS edges, "
        "(SELECT count(*) FROM rollout_edges e WHERE e.rollout_id=r.rollout_id "
        " AND e.state != 'waiting') AS moved "
        "FROM rollouts r ORDER BY r.created_at DESC, r.rollout_id"
    )
    for row in rows:
        row["label"] = _label(str(row["state"]), int(row["wave"]))
        row["forced_unblessed"] = bool(row["forced_unblessed"])
    return rows


def status(store: Store, rollout_id: str) -> dict[str, Any]:
    """One rollout: its plan, state, every edge (wave, state, what it ran before, whether
    it settled) and its events, oldest first."""
    loaded = load(store.conn, rollout_id)
    rollout = loaded.rollout
    head = store.one("SELECT * FROM rollouts WHERE rollout_id=?", (rollout_id,)) or {}
    edges = []
    for edge in rollout.edges:
        row = loaded.rows[edge.edge]
        settled = (
            None
            if row["deployment_id"] is None
            else health.settled_at(store.conn, edge.edge, str(row["deployment_id"]))
        )
        edges.append(
            {
                "edge": edge.edge,
                "wave": edge.wave,
                "state": edge.state.value,
                "previous_model": row["previous_model"],
                "moved_at": row["moved_at"],
                "settled_at": settled,
                "deployment_id": row["deployment_id"],
                "serving": store.scalar("SELECT serving FROM edges WHERE edge=?", (edge.edge,)),
                "restored_at": row["restored_at"],
            }
        )
    return {
        "rollout_id": rollout_id,
        "model": rollout.model,
        "state": rollout.state.value,
        "wave": rollout.wave,
        "label": rollout.label,
        "reason": head.get("reason", ""),
        "forced_unblessed": bool(head.get("forced_unblessed")),
        "created_at": head.get("created_at"),
        "updated_at": head.get("updated_at"),
        "finished_at": head.get("finished_at"),
        "plan": rollout.plan.to_json_dict(),
        "edges": edges,
        "events": events(store.conn, rollout_id),
    }


def events(conn: sqlite3.Connection, rollout_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT at, kind, edge, detail FROM rollout_events WHERE rollout_id=? ORDER BY at, rowid",
        (rollout_id,),
    ).fetchall()
    return [
        {"at": at, "kind": kind, "edge": edge, "detail": detail} for at, kind, edge, detail in rows
    ]


def latest_id(store: Store) -> str | None:
    value = store.scalar("SELECT rollout_id FROM rollouts ORDER BY created_at DESC LIMIT 1")
    return None if value is None else str(value)


def outcome(store: Store, rollout_id: str) -> tuple[bool | None, str]:
    """(True, '') completed; (False, why) aborted or rolled back; (None, state) running."""
    loaded = load(store.conn, rollout_id)
    state = loaded.rollout.state
    if state is RolloutState.COMPLETED:
        return True, ""
    reason = str(store.scalar("SELECT reason FROM rollouts WHERE rollout_id=?", (rollout_id,)))
    if state is RolloutState.ROLLED_BACK:
        return False, reason
    if state is RolloutState.ABORTED:
        waiting = [e.edge for e in loaded.rollout.edges if e.state is EdgeState.ROLLING_BACK]
        if not waiting:
            return False, reason
    return None, loaded.rollout.label


def _label(state: str, wave: int) -> str:
    if state == RolloutState.WAVE.value:
        return f"wave {wave}"
    if state == RolloutState.PAUSED.value:
        where = "pending" if wave < 0 else "canary" if wave == 0 else f"wave {wave}"
        return f"paused ({where})"
    return state

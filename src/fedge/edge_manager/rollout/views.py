"""Staged rollouts as operators see them, for the CLI, JSON and the console.

The rows come from rollout_store.py; this module shapes them (labels, per-edge status).
"""

from dataclasses import asdict, dataclass
from typing import Any

from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.rollout import health
from fedge.edge_manager.rollout import store as rollout_store
from fedge.edge_manager.rollout.machine import EdgeState, RolloutState
from fedge.edge_manager.rollout.writes import load
from fedge.edge_manager.store import Store, Transaction


@dataclass(frozen=True)
class RolloutListing(rollout_store.RolloutSummary):
    """One line of ``fedge rollout list`` and the console's rollouts page, with the
    state as shown (``wave 2``, ``paused (canary)``)."""

    label: str


def list_rollouts(store: Store) -> list[RolloutListing]:
    """Every rollout, newest first."""
    return [
        RolloutListing(**asdict(s), label=_label(s.state, s.wave))
        for s in rollout_store.summaries(store.conn)
    ]


def status(store: Store, rollout_id: str) -> dict[str, Any]:
    """One rollout: its plan, state, every edge (wave, state, what it ran before, whether
    it settled) and its events, oldest first."""
    loaded = load(store.conn, rollout_id)
    rollout = loaded.rollout
    stored = rollout_store.rollout_row(store.conn, rollout_id)
    head: dict[str, Any] = {} if stored is None else asdict(stored)
    edges = []
    for edge in rollout.edges:
        row = loaded.rows[edge.edge]
        settled = (
            None
            if row.deployment_id is None
            else health.settled_at(store.conn, edge.edge, row.deployment_id)
        )
        edges.append(
            {
                "edge": edge.edge,
                "wave": edge.wave,
                "state": edge.state.value,
                "previous_model": row.previous_model,
                "previous_anomaly": row.previous_anomaly,
                "moved_at": row.moved_at,
                "settled_at": settled,
                "deployment_id": row.deployment_id,
                "serving": edge_store.serving(store.conn, edge.edge),
                "restored_at": row.restored_at,
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


def events(conn: Transaction, rollout_id: str) -> list[dict[str, Any]]:
    return [asdict(event) for event in rollout_store.events(conn, rollout_id)]


def latest_id(store: Store) -> str | None:
    return rollout_store.newest_id(store.conn)


def outcome(store: Store, rollout_id: str) -> tuple[bool | None, str]:
    """(True, '') completed; (False, why) aborted, rolled back or degraded (a station rolled
    back on its own after completion); (None, state) running."""
    loaded = load(store.conn, rollout_id)
    state = loaded.rollout.state
    if state is RolloutState.COMPLETED:
        return True, ""
    row = rollout_store.rollout_row(store.conn, rollout_id)
    reason = str(None if row is None else row.reason)
    if state in (RolloutState.ROLLED_BACK, RolloutState.DEGRADED):
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

"""Reads over the manager's rollout, deployment and edge tables that put one incident on one
page (issue 30, item 5): which rollouts sent an edge back, which rollout moved an edge to
the model an alert is about, which edges serve a model. Read-only; what the pages make of
the values stays in incidents.py and model_page.py.
"""

from dataclasses import dataclass

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class EdgeInRollout:
    """An edge's part in one rollout, with the rollout's head."""

    rollout_id: str
    model: str  # the rollout's model, 'name:version'
    rollout_state: str
    reason: str
    finished_at: float | None
    updated_at: float
    edge: str
    edge_state: str  # waiting|moved|rolling_back|rolled_back|unconfirmed
    previous_model: str
    moved_at: float | None
    restored_at: float | None
    deployment_id: str


_EDGE_IN_ROLLOUT = (
    "SELECT r.rollout_id, r.model_name || ':' || r.model_version AS model, r.state, r.reason, "
    "r.finished_at, r.updated_at, e.edge, e.state AS edge_state, e.previous_model, e.moved_at, "
    "e.restored_at, e.deployment_id FROM rollout_edges e "
    "JOIN rollouts r ON r.rollout_id = e.rollout_id"
)


def _edge_in_rollout(row: dict[str, object]) -> EdgeInRollout:
    def number(key: str) -> float | None:
        value = row[key]
        return None if value is None else float(str(value))

    return EdgeInRollout(
        rollout_id=str(row["rollout_id"]),
        model=str(row["model"]),
        rollout_state=str(row["state"]),
        reason=str(row["reason"]),
        finished_at=number("finished_at"),
        updated_at=float(str(row["updated_at"])),
        edge=str(row["edge"]),
        edge_state=str(row["edge_state"]),
        previous_model=str(row["previous_model"] or ""),
        moved_at=number("moved_at"),
        restored_at=number("restored_at"),
        deployment_id=str(row["deployment_id"] or ""),
    )


def rollouts_of_edge(store: Store, edge: str, limit: int = 20) -> list[EdgeInRollout]:
    """``edge``'s part in its newest ``limit`` rollouts, newest first."""
    rows = store.query(
        _EDGE_IN_ROLLOUT + " WHERE e.edge = ? ORDER BY r.created_at DESC LIMIT ?", (edge, limit)
    )
    return [_edge_in_rollout(r) for r in rows]


def rollouts_of_model(store: Store, name: str, version: int) -> list[EdgeInRollout]:
    """Every edge of every rollout of ``name:version``, newest rollout first."""
    rows = store.query(
        _EDGE_IN_ROLLOUT + " WHERE r.model_name = ? AND r.model_version = ? "
        "ORDER BY r.created_at DESC, e.edge",
        (name, version),
    )
    return [_edge_in_rollout(r) for r in rows]


def rollout_that_moved(store: Store, edge: str, model: str, at: float) -> str | None:
    """The newest rollout that moved ``edge`` to ``model`` at or before ``at`` (None: the
    model reached it otherwise, e.g. ``fedge deploy``)."""
    name, _, version = model.rpartition(":")
    if not version.isdigit():
        return None
    row = store.one(
        "SELECT r.rollout_id FROM rollout_edges e JOIN rollouts r ON r.rollout_id = e.rollout_id "
        "WHERE e.edge = ? AND r.model_name = ? AND r.model_version = ? AND e.moved_at <= ? "
        "ORDER BY e.moved_at DESC LIMIT 1",
        (edge, name, int(version), at),
    )
    return None if row is None else str(row["rollout_id"])


def degraded_by(store: Store, edge: str) -> list[tuple[str, float, str]]:
    """(rollout, when, detail) of each rollout ``edge`` turned degraded by rolling its
    model back on its own after completion, newest first."""
    rows = store.query(
        "SELECT rollout_id, at, detail FROM rollout_events WHERE edge = ? AND kind = 'degraded' "
        "ORDER BY at DESC",
        (edge,),
    )
    return [(str(r["rollout_id"]), float(r["at"]), str(r["detail"])) for r in rows]


def edges_serving(store: Store, model: str) -> list[str]:
    """The edges that last reported serving ``model``, by name."""
    rows = store.query("SELECT edge FROM edges WHERE serving = ? ORDER BY edge", (model,))
    return [str(r["edge"]) for r in rows]


def deploy_reasons(store: Store, edge: str, deployment_id: str) -> list[tuple[float, str, str]]:
    """(when, stage, reason) of what ``edge`` reported of ``deployment_id``, oldest first."""
    rows = store.query(
        "SELECT at, stage, reason FROM deploy_events WHERE edge = ? AND deployment_id = ? "
        "ORDER BY at",
        (edge, deployment_id),
    )
    return [(float(r["at"]), str(r["stage"]), str(r["reason"])) for r in rows]

"""Which edges an unfinished staged rollout holds, and the refusal of other changes to them.

A staged rollout owns its edges' model and thresholds until it ends: a ``fedge deploy`` or
a threshold pushed to one of them meanwhile would be undone by the rollout's rollback, or
would make the rollback restore the wrong model. Such changes are refused, naming the
rollout, unless the operator forces them; the rollout's own moves and rollbacks pass its
id (``within``) and go through.
"""

import sqlite3

from fedge.edge_manager.rollout_plan import RolloutError


def active_rollouts_of(conn: sqlite3.Connection, edges: list[str]) -> dict[str, str]:
    """edge -> id of the unfinished rollout it belongs to, for ``edges``."""
    if not edges:
        return {}
    marks = ",".join("?" * len(edges))
    rows = conn.execute(
        f"SELECT e.edge, r.rollout_id FROM rollout_edges e JOIN rollouts r "
        f"ON r.rollout_id = e.rollout_id WHERE r.finished_at IS NULL AND e.edge IN ({marks})",
        tuple(edges),
    ).fetchall()
    return {str(edge): str(rid) for edge, rid in rows}


def refuse_if_in_rollout(
    conn: sqlite3.Connection,
    edges: list[str],
    what: str,
    *,
    within: str | None = None,
    force: bool = False,
) -> None:
    """Raise :class:`RolloutError` if an edge of ``edges`` is in an unfinished rollout
    other than ``within`` (``what``: the refused change, e.g. "deploy")."""
    if force:
        return
    held = {e: rid for e, rid in active_rollouts_of(conn, edges).items() if rid != within}
    if not held:
        return
    listed = ", ".join(f"{edge} ({rid})" for edge, rid in sorted(held.items()))
    first = sorted(set(held.values()))[0]
    raise RolloutError(
        f"cannot {what}: edge(s) in an unfinished staged rollout: {listed}; the rollout owns "
        f"their model and thresholds until it ends. Run `fedge rollout abort {first}` first, "
        f"or pass --force to {what} anyway; nothing was changed"
    )

"""Which edges an unfinished staged rollout holds, and the refusal of other changes to them.

A staged rollout owns its edges' model and thresholds until it ends: a ``fedge deploy`` or
a threshold pushed to one of them meanwhile would be undone by the rollout's rollback, or
would make the rollback restore the wrong model. Such changes are refused, naming the
rollout, unless the operator forces them; the rollout's own moves and rollbacks pass its
id (``within``) and go through. Which rollouts hold which edges is read in
rollout_store.py.
"""

from fedge.edge_manager.rollout import store as rollout_store
from fedge.edge_manager.rollout.plan import RolloutError
from fedge.edge_manager.store import Transaction


def active_rollouts_of(conn: Transaction, edges: list[str]) -> dict[str, str]:
    """edge -> id of the unfinished rollout it belongs to, for ``edges``."""
    return rollout_store.unfinished_rollouts_of(conn, edges)


def refuse_if_in_rollout(
    conn: Transaction,
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

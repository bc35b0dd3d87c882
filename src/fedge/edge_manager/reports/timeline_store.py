"""The closed loop's record in the manager's store, read back in time order.

The demo draws what happened from the stored rows (fedge.demo.timeline): alerts raised,
the gate's verdicts, rollout events, the loop's steps and the stations' deploy statuses,
each since a moment. The statements are here; they return frozen dataclasses.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from fedge.edge_manager.store import Store


def _in(values: Sequence[str]) -> str:
    return ", ".join("?" for _ in values)


@dataclass(frozen=True)
class RaisedAlert:
    edge: str
    model: str
    kind: str
    raised_at: float
    cleared_at: float | None


def alerts_raised(store: Store, since: float) -> list[RaisedAlert]:
    """The alerts raised at or after ``since``."""
    rows = store.conn.execute(
        "SELECT edge, model, kind, raised_at, cleared_at FROM alerts WHERE raised_at >= ?",
        (since,),
    ).fetchall()
    return [RaisedAlert(*row) for row in rows]


@dataclass(frozen=True)
class GateVerdict:
    name: str
    version: int
    blessed: int  # 1: blessed, 0: not
    at: float


def gate_verdicts(store: Store, since: float) -> list[GateVerdict]:
    """The gate's verdicts made at or after ``since``, oldest first."""
    rows = store.conn.execute(
        "SELECT name, version, blessed, at FROM gate_results WHERE at >= ? ORDER BY at", (since,)
    ).fetchall()
    return [GateVerdict(*row) for row in rows]


@dataclass(frozen=True)
class RolloutMark:
    """A rollout event with the model rolled out (``edge`` '': the rollout's own)."""

    at: float
    kind: str
    edge: str
    model_name: str
    model_version: int


def rollout_events(store: Store, since: float, kinds: Sequence[str]) -> list[RolloutMark]:
    """The rollout events of ``kinds`` at or after ``since``, oldest first."""
    rows = store.conn.execute(
        "SELECT e.at, e.kind, e.edge, r.model_name, r.model_version FROM rollout_events e "
        f"JOIN rollouts r USING (rollout_id) WHERE e.at >= ? AND e.kind IN ({_in(kinds)}) "
        "ORDER BY e.at",
        (since, *kinds),
    ).fetchall()
    return [RolloutMark(*row) for row in rows]


@dataclass(frozen=True)
class LoopStep:
    at: float
    step: str
    detail: str


def loop_steps(store: Store, since: float) -> list[LoopStep]:
    """The steps continuous-training runs took at or after ``since``, oldest first."""
    rows = store.conn.execute(
        "SELECT at, step, detail FROM loop_events WHERE at >= ? ORDER BY at", (since,)
    ).fetchall()
    return [LoopStep(*row) for row in rows]


@dataclass(frozen=True)
class DeployMark:
    edge: str
    stage: str
    serving: str
    at: float


def deploy_events(store: Store, since: float, stages: Sequence[str]) -> list[DeployMark]:
    """The stations' deploy statuses of ``stages`` at or after ``since``, oldest first."""
    rows = store.conn.execute(
        "SELECT edge, stage, serving, at FROM deploy_events WHERE at >= ? "
        f"AND stage IN ({_in(stages)}) ORDER BY at",
        (since, *stages),
    ).fetchall()
    return [DeployMark(*row) for row in rows]

"""The staged rollout state machine: pure decisions over frozen dataclasses.

A rollout moves a model (and the thresholds tied to it) to its target edges wave by
wave: the canary (wave 0), then waves 1..N of the plan. A wave's health window starts
once every edge of the wave has settled (reported the new model active, or failed) and
the next wave moves only after it. The abort criteria are checked on every tick against
what each moved edge reported since it moved (canary, waves and while paused); an abort
-- tripped or asked for -- rolls every moved edge back to its previous model and
thresholds. The adapter (rollouts.py) reads the store, calls :func:`step` and writes
the :class:`Step` in one transaction, so a manager killed at any point resumes from the
store (the AWS IoT Jobs model of rollout and abort configs; issue "The closed loop").

States::

    pending -> canary -> wave 1 -> ... -> wave N -> completed
       \\________\\_________\\__ paused (resume returns to the wave) __/
    any of the above -> aborted -> rolled_back (every moved edge back; or stays
                                                aborted when nothing had moved)
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from fedge.edge_manager.desired import next_config
from fedge.edge_manager.rollout_plan import RolloutError, RolloutPlan
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import Thresholds


class RolloutState(StrEnum):
    PENDING = "pending"
    CANARY = "canary"
    WAVE = "wave"
    PAUSED = "paused"
    COMPLETED = "completed"
    ABORTED = "aborted"
    ROLLED_BACK = "rolled_back"


MOVING = frozenset({RolloutState.PENDING, RolloutState.CANARY, RolloutState.WAVE})


class EdgeState(StrEnum):
    WAITING = "waiting"  # its wave has not come
    MOVED = "moved"  # on the new model (or on its way to it)
    ROLLING_BACK = "rolling_back"  # sent back, not yet confirmed on the previous model
    ROLLED_BACK = "rolled_back"  # serving the previous model and thresholds again


class EventKind(StrEnum):
    STARTED = "started"
    MOVED = "moved"
    WAVE = "wave"
    PAUSED = "paused"
    RESUMED = "resumed"
    ABORTED = "aborted"
    ROLLBACK = "rollback"
    ROLLED_BACK = "rolled_back"
    COMPLETED = "completed"
    FORCED = "forced"


@dataclass(frozen=True)
class Event:
    kind: EventKind
    detail: str
    edge: str = ""


@dataclass(frozen=True)
class RolloutEdge:
    edge: str
    wave: int
    state: EdgeState = EdgeState.WAITING
    moved_at: float | None = None


@dataclass(frozen=True)
class Rollout:
    rollout_id: str
    model: str  # "inspect:4"
    plan: RolloutPlan
    state: RolloutState
    wave: int  # the last wave moved; -1 before the first
    edges: tuple[RolloutEdge, ...]

    @property
    def label(self) -> str:
        """``canary``, ``wave 2``, ``paused (wave 1)``, ``rolled_back``..."""
        if self.state is RolloutState.WAVE:
            return f"wave {self.wave}"
        if self.state is RolloutState.PAUSED:
            return f"paused ({_moving_state(self.wave).value}{_number(self.wave)})"
        return self.state.value

    def in_wave(self, wave: int) -> list[RolloutEdge]:
        return [e for e in self.edges if e.wave == wave]


@dataclass(frozen=True)
class EdgeHealth:
    """What a moved edge reported since it moved (rollout_health reads it).

    ``settled_at``: when it reported the new model active or failed (None: not yet).
    ``metrics``: the observed value of each abort metric that can be judged yet.
    ``back``: it serves its previous model with its restored thresholds.
    """

    settled_at: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    back: bool = False


@dataclass(frozen=True)
class Step:
    """What to do now: edges to move and to send back, edges confirmed back, the next
    state and wave, and the events to record. ``finished``: nothing more will happen."""

    state: RolloutState
    wave: int
    move: tuple[str, ...] = ()
    roll_back: tuple[str, ...] = ()
    back: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    finished: bool = False

    @property
    def changes(self) -> bool:
        return bool(self.move or self.roll_back or self.back or self.events)


def initial_edges(plan: RolloutPlan) -> tuple[RolloutEdge, ...]:
    return tuple(RolloutEdge(edge, wave) for edge, wave in plan.assignment())


def step(rollout: Rollout, health_by_edge: Mapping[str, EdgeHealth], now: float) -> Step:
    """The rollout's next step given what its edges reported (``now`` in seconds)."""
    state, wave = rollout.state, rollout.wave
    if state is RolloutState.ABORTED:
        return _confirm_back(rollout, health_by_edge)
    if state in (RolloutState.COMPLETED, RolloutState.ROLLED_BACK):
        return Step(state, wave, finished=True)
    tripped = _tripped(rollout, health_by_edge)
    if tripped:
        return abort(rollout, "; ".join(tripped))
    if state is RolloutState.PAUSED:
        return Step(state, wave)
    if state is RolloutState.PENDING:
        return _next_wave(rollout, now, started=True)
    edges = rollout.in_wave(wave)
    settled = [health_by_edge.get(e.edge, EdgeHealth()).settled_at for e in edges]
    if any(at is None for at in settled):
        return Step(state, wave)  # the wave's health window has not started yet
    last = max((at for at in settled if at is not None), default=now)
    if now - last < rollout.plan.health_window_s:
        return Step(state, wave)
    return _next_wave(rollout, now, started=False)


def _next_wave(rollout: Rollout, now: float, *, started: bool) -> Step:
    later = sorted({e.wave for e in rollout.edges if e.wave > rollout.wave})
    events = [Event(EventKind.STARTED, f"rolling out {rollout.model}")] if started else []
    if not later:
        events.append(Event(EventKind.COMPLETED, f"every target edge runs {rollout.model}"))
        return Step(RolloutState.COMPLETED, rollout.wave, events=tuple(events), finished=True)
    wave = later[0]
    move = tuple(e.edge for e in rollout.in_wave(wave))
    name = f"{_moving_state(wave).value}{_number(wave)}"
    events.append(Event(EventKind.WAVE, f"{name}: {', '.join(move)}"))
    events += [Event(EventKind.MOVED, f"to {rollout.model}", edge) for edge in move]
    return Step(_moving_state(wave), wave, move=move, events=tuple(events))


def _tripped(rollout: Rollout, health_by_edge: Mapping[str, EdgeHealth]) -> list[str]:
    """Each abort criterion that holds on a moved edge, as ``st-03: error_rate=0.2 > 0.01``."""
    found = []
    for edge in rollout.edges:
        if edge.state is not EdgeState.MOVED:
            continue
        metrics = health_by_edge.get(edge.edge, EdgeHealth()).metrics
        for criterion in rollout.plan.abort_if:
            observed = metrics.get(criterion.metric.value)
            if observed is not None and criterion.tripped(observed):
                found.append(
                    f"{edge.edge}: {criterion.metric.value}={observed:.4g} "
                    f"{criterion.op.value} {criterion.value:g}"
                )
    return found


def abort(rollout: Rollout, reason: str) -> Step:
    """Stop the rollout and send every moved edge back (asked for, or criteria tripped)."""
    if rollout.state not in MOVING | {RolloutState.PAUSED}:
        raise RolloutError(
            f"rollout {rollout.rollout_id} is {rollout.label}; only a running or paused "
            "rollout can be aborted"
        )
    back = tuple(e.edge for e in rollout.edges if e.state is EdgeState.MOVED)
    events = [Event(EventKind.ABORTED, reason)]
    events += [Event(EventKind.ROLLBACK, "to its previous model and thresholds", e) for e in back]
    # Nothing moved: nothing to wait for, the rollout ends here as aborted.
    return Step(
        RolloutState.ABORTED, rollout.wave, roll_back=back, events=tuple(events), finished=not back
    )


def _confirm_back(rollout: Rollout, health_by_edge: Mapping[str, EdgeHealth]) -> Step:
    pending = [e for e in rollout.edges if e.state is EdgeState.ROLLING_BACK]
    back = tuple(e.edge for e in pending if health_by_edge.get(e.edge, EdgeHealth()).back)
    events = [
        Event(EventKind.ROLLED_BACK, "previous model and thresholds in force", e) for e in back
    ]
    if pending and len(back) == len(pending):
        moved = sum(1 for e in rollout.edges if e.state is not EdgeState.WAITING)
        events.append(Event(EventKind.ROLLED_BACK, f"all {moved} moved edge(s) are back"))
        return Step(
            RolloutState.ROLLED_BACK, rollout.wave, back=back, events=tuple(events), finished=True
        )
    return Step(
        RolloutState.ABORTED, rollout.wave, back=back, events=tuple(events), finished=not pending
    )


def pause(rollout: Rollout) -> Step:
    """No further wave moves until resumed; abort criteria are still checked."""
    if rollout.state not in MOVING:
        raise RolloutError(
            f"rollout {rollout.rollout_id} is {rollout.label}; only a pending or moving "
            "rollout can be paused"
        )
    return Step(RolloutState.PAUSED, rollout.wave, events=(Event(EventKind.PAUSED, "by operator"),))


def resume(rollout: Rollout) -> Step:
    """Back to the wave it was paused in; time spent paused counts toward its window."""
    if rollout.state is not RolloutState.PAUSED:
        raise RolloutError(
            f"rollout {rollout.rollout_id} is {rollout.label}, not paused; nothing to resume"
        )
    state = _moving_state(rollout.wave)
    return Step(state, rollout.wave, events=(Event(EventKind.RESUMED, "by operator"),))


def apply(rollout: Rollout, result: Step, now: float) -> Rollout:
    """The rollout after ``result``: what the adapter writes, as a value (for tests too)."""
    edges = []
    for edge in rollout.edges:
        if edge.edge in result.move:
            edge = dataclasses.replace(edge, state=EdgeState.MOVED, moved_at=now)
        elif edge.edge in result.roll_back:
            edge = dataclasses.replace(edge, state=EdgeState.ROLLING_BACK)
        elif edge.edge in result.back:
            edge = dataclasses.replace(edge, state=EdgeState.ROLLED_BACK)
        edges.append(edge)
    return dataclasses.replace(rollout, state=result.state, wave=result.wave, edges=tuple(edges))


def _moving_state(wave: int) -> RolloutState:
    if wave < 0:
        return RolloutState.PENDING
    return RolloutState.CANARY if wave == 0 else RolloutState.WAVE


def _number(wave: int) -> str:
    return f" {wave}" if wave > 0 else ""


# -- the thresholds that travel with a model


def moved_config(
    current: EdgeConfig | None,
    *,
    fleet: str,
    edge: str,
    model: str,
    recommended: Thresholds | None,
    now: float,
) -> EdgeConfig:
    """The edge's next config when it moves to ``model``: tied to it, with the model's
    recommended thresholds (the gate's, else the manifest's), else the ones in force."""
    config = next_config(current, fleet=fleet, edge=edge, now=now, model=model)
    if recommended is None:
        return config
    return dataclasses.replace(
        config,
        default_threshold=recommended.default_threshold,
        class_thresholds=dict(recommended.class_thresholds),
    )


def restored_config(
    current: EdgeConfig | None,
    previous: EdgeConfig | None,
    *,
    fleet: str,
    edge: str,
    previous_model: str | None,
    now: float,
) -> EdgeConfig:
    """The edge's next config when it goes back: the thresholds it had before it moved
    (the defaults if it had no config), tied to its previous model again."""
    config = next_config(current, fleet=fleet, edge=edge, now=now, model=previous_model)
    before = previous or EdgeConfig(fleet=fleet, edge=edge, version=1)
    return dataclasses.replace(
        config,
        default_threshold=before.default_threshold,
        class_thresholds=dict(before.class_thresholds),
    )

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

    pending -> canary -> wave 1 -> ... -> wave N -> completed -> degraded
       \\________\\_________\\__ paused (resume returns to the wave) __/
    any of the above -> aborted -> rolled_back (every moved edge back; or stays
                                                aborted when nothing had moved)

A wave's window ends only when each of its edges also reported its own probation
``passed`` (``plan.wait_for_probation``, the default; an edge with no verdict
``plan.probation_timeout_s`` after it settled aborts the rollout). A station that rolls
the model back on its own after the rollout completed (possible without the wait) turns
it ``degraded``: the fleet serves two versions, which an operator resolves (``abort``
sends the others back too).

Nothing waits forever. A moved edge that fails to activate, rolls the model back on its
own, or has not settled ``plan.activation_timeout_s`` after its move aborts the rollout
(an implicit criterion besides ``--abort-if``). An edge sent back that has not confirmed
its previous model ``plan.rollback_timeout_s`` after the abort (offline, redeployed) is
marked unconfirmed and the rollout ends rolled back, its reason naming the edge; an
operator can end that wait at once (:func:`force_finish`, ``abort --force``).

Deliberately not handled here: clocks. Every time this module compares (``moved_at``,
``settled_at``, ``aborted_at``, ``now``) is the manager's; the adapter reads the edges'
reports by the manager's receive time (rollout_health.py), never by the station's clock.
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from fedge.edge_manager.rollout.plan import RolloutError, RolloutPlan


class RolloutState(StrEnum):
    PENDING = "pending"
    CANARY = "canary"
    WAVE = "wave"
    PAUSED = "paused"
    COMPLETED = "completed"
    DEGRADED = "degraded"  # completed, then a station rolled the model back on its own
    ABORTED = "aborted"
    ROLLED_BACK = "rolled_back"


MOVING = frozenset({RolloutState.PENDING, RolloutState.CANARY, RolloutState.WAVE})


class EdgeState(StrEnum):
    WAITING = "waiting"  # its wave has not come
    MOVED = "moved"  # on the new model (or on its way to it)
    ROLLING_BACK = "rolling_back"  # sent back, not yet confirmed on the previous model
    ROLLED_BACK = "rolled_back"  # serving the previous model and thresholds again
    UNCONFIRMED = "unconfirmed"  # sent back, never confirmed it before the rollback deadline


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
    DEGRADED = "degraded"
    FORCED = "forced"
    UNCONFIRMED = "unconfirmed"
    ERROR = "error"


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
    reason: str = ""  # why it was aborted (or stopped by an error)
    aborted_at: float | None = None  # when it was aborted: the rollback deadline runs from it

    @property
    def pair(self) -> str:
        """The model, and the anomaly model beside it when the plan carries one."""
        beside = self.plan.anomaly
        return self.model if beside is None else f"{self.model} with anomaly model {beside}"

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
    ``failed``: it reported the rollout's deployment failed or rolled back locally (an
    abort whatever the criteria say).
    ``passed_at``: when it reported the new model passed its probation (None: not yet).
    """

    settled_at: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    back: bool = False
    failed: bool = False
    passed_at: float | None = None


@dataclass(frozen=True)
class Step:
    """What to do now: edges to move and to send back, edges confirmed back (or given up
    on: ``unconfirmed``), the next state and wave, the events to record and the rollout's
    new ``reason`` (None: unchanged). ``finished``: nothing more will happen."""

    state: RolloutState
    wave: int
    move: tuple[str, ...] = ()
    roll_back: tuple[str, ...] = ()
    back: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    finished: bool = False
    unconfirmed: tuple[str, ...] = ()
    reason: str | None = None

    @property
    def changes(self) -> bool:
        return bool(self.move or self.roll_back or self.back or self.unconfirmed or self.events)


def initial_edges(plan: RolloutPlan) -> tuple[RolloutEdge, ...]:
    return tuple(RolloutEdge(edge, wave) for edge, wave in plan.assignment())


def step(rollout: Rollout, health_by_edge: Mapping[str, EdgeHealth], now: float) -> Step:
    """The rollout's next step given what its edges reported (``now`` in seconds)."""
    state, wave = rollout.state, rollout.wave
    if state is RolloutState.ABORTED:
        return _confirm_back(rollout, health_by_edge, now)
    if state in (RolloutState.COMPLETED, RolloutState.ROLLED_BACK, RolloutState.DEGRADED):
        return Step(state, wave, finished=True)
    tripped = _tripped(rollout, health_by_edge, now)
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
    if rollout.plan.wait_for_probation and any(
        health_by_edge.get(e.edge, EdgeHealth()).passed_at is None for e in edges
    ):
        return Step(state, wave)  # a station's own verdict is still out
    return _next_wave(rollout, now, started=False)


def _next_wave(rollout: Rollout, now: float, *, started: bool) -> Step:
    later = sorted({e.wave for e in rollout.edges if e.wave > rollout.wave})
    events = [Event(EventKind.STARTED, f"rolling out {rollout.pair}")] if started else []
    if not later:
        events.append(Event(EventKind.COMPLETED, f"every target edge runs {rollout.pair}"))
        return Step(RolloutState.COMPLETED, rollout.wave, events=tuple(events), finished=True)
    wave = later[0]
    move = tuple(e.edge for e in rollout.in_wave(wave))
    name = f"{_moving_state(wave).value}{_number(wave)}"
    events.append(Event(EventKind.WAVE, f"{name}: {', '.join(move)}"))
    events += [Event(EventKind.MOVED, f"to {rollout.pair}", edge) for edge in move]
    return Step(_moving_state(wave), wave, move=move, events=tuple(events))


def _tripped(rollout: Rollout, health_by_edge: Mapping[str, EdgeHealth], now: float) -> list[str]:
    """Each abort criterion that holds on a moved edge, as ``st-03: error_rate=0.2 > 0.01``,
    and the implicit one: a failed activation, or none within the activation timeout."""
    found = []
    timeout = rollout.plan.activation_timeout_s
    for edge in rollout.edges:
        if edge.state is not EdgeState.MOVED:
            continue
        health = health_by_edge.get(edge.edge, EdgeHealth())
        named = []
        for criterion in rollout.plan.abort_if:
            observed = health.metrics.get(criterion.metric.value)
            if observed is not None and criterion.tripped(observed):
                named.append(
                    f"{edge.edge}: {criterion.metric.value}={observed:.4g} "
                    f"{criterion.op.value} {criterion.value:g}"
                )
        found += named
        if any(": failed_activation=" in reason for reason in named):
            continue
        if health.failed:
            found.append(f"{edge.edge}: failed_activation=1 (a failed activation always aborts)")
        elif (
            health.settled_at is None
            and edge.moved_at is not None
            and now - edge.moved_at >= timeout
        ):
            found.append(
                f"{edge.edge}: failed_activation=1 (not settled within the {timeout:g}s "
                "activation timeout)"
            )
        elif (
            rollout.plan.wait_for_probation
            and health.settled_at is not None
            and health.passed_at is None
            and now - health.settled_at >= rollout.plan.probation_timeout_s
        ):
            found.append(
                f"{edge.edge}: probation_timeout (no probation verdict within "
                f"{rollout.plan.probation_timeout_s:g}s of activation)"
            )
    return found


def degrade(rollout: Rollout, rolled_back: Mapping[str, str]) -> Step:
    """A completed rollout some of whose edges rolled the model back on their own
    (``rolled_back``: edge -> the agent's reason): it is ``degraded``, the fleet serves two
    versions. Nothing is sent anywhere; an operator decides (``abort`` sends the rest back)."""
    if rollout.state is not RolloutState.COMPLETED:
        raise RolloutError(
            f"rollout {rollout.rollout_id} is {rollout.label}; only a completed one degrades"
        )
    events = tuple(
        Event(EventKind.DEGRADED, f"rolled {rollout.model} back on its own: {why}", edge)
        for edge, why in sorted(rolled_back.items())
    )
    reason = f"{', '.join(sorted(rolled_back))} rolled {rollout.model} back after completion"
    return Step(RolloutState.DEGRADED, rollout.wave, events=events, finished=True, reason=reason)


def abort(rollout: Rollout, reason: str) -> Step:
    """Stop the rollout and send every moved edge back (asked for, or criteria tripped)."""
    if rollout.state is RolloutState.ABORTED:
        waiting = ", ".join(e.edge for e in rollout.edges if e.state is EdgeState.ROLLING_BACK)
        raise RolloutError(
            f"rollout {rollout.rollout_id} is already aborted and waits for {waiting or 'nothing'}"
            " to confirm the previous model; `fedge rollout abort "
            f"{rollout.rollout_id} --force` ends it without that confirmation (recorded)"
        )
    if rollout.state not in MOVING | {RolloutState.PAUSED, RolloutState.DEGRADED}:
        raise RolloutError(
            f"rollout {rollout.rollout_id} is {rollout.label}; only a running, paused or "
            "degraded rollout can be aborted"
        )
    back = tuple(e.edge for e in rollout.edges if e.state is EdgeState.MOVED)
    events = [Event(EventKind.ABORTED, reason)]
    events += [Event(EventKind.ROLLBACK, "to its previous model and thresholds", e) for e in back]
    # Nothing moved: nothing to wait for, the rollout ends here as aborted.
    return Step(
        RolloutState.ABORTED,
        rollout.wave,
        roll_back=back,
        events=tuple(events),
        finished=not back,
        reason=reason,
    )


def _confirm_back(rollout: Rollout, health_by_edge: Mapping[str, EdgeHealth], now: float) -> Step:
    """Edges confirmed back; past the rollback deadline the rest are given up on."""
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
    timeout = rollout.plan.rollback_timeout_s
    # aborted_at is when it was aborted (the store's "aborted" event); without one the
    # deadline cannot be placed and `abort --force` ends the wait.
    if pending and rollout.aborted_at is not None and now - rollout.aborted_at >= timeout:
        late = tuple(e.edge for e in pending if e.edge not in back)
        why = f"did not confirm the previous model within the {timeout:g}s rollback timeout"
        return _give_up(rollout, back, late, why, events)
    return Step(
        RolloutState.ABORTED, rollout.wave, back=back, events=tuple(events), finished=not pending
    )


def _give_up(
    rollout: Rollout,
    back: tuple[str, ...],
    late: tuple[str, ...],
    why: str,
    events: list[Event],
    extra: tuple[Event, ...] = (),
) -> Step:
    """End an aborted rollout as rolled back with ``late`` marked unconfirmed."""
    late = tuple(sorted(late))
    events = [*events, *extra]
    events += [Event(EventKind.UNCONFIRMED, why, edge) for edge in late]
    note = f"not confirmed back: {', '.join(late)} ({why})"
    events.append(Event(EventKind.ROLLED_BACK, f"finished; {note}"))
    return Step(
        RolloutState.ROLLED_BACK,
        rollout.wave,
        back=back,
        unconfirmed=late,
        events=tuple(events),
        finished=True,
        reason=f"{rollout.reason}; {note}" if rollout.reason else note,
    )


def force_finish(rollout: Rollout, health_by_edge: Mapping[str, EdgeHealth]) -> Step:
    """``abort --force`` on an aborted rollout still waiting for edges to confirm: end it
    now (edges that did confirm count as back, the others are unconfirmed), recorded."""
    if rollout.state is not RolloutState.ABORTED:
        raise RolloutError(
            f"rollout {rollout.rollout_id} is {rollout.label}; --force ends an aborted rollout "
            "that waits for edges to confirm the previous model (abort it first)"
        )
    pending = [e for e in rollout.edges if e.state is EdgeState.ROLLING_BACK]
    back = tuple(e.edge for e in pending if health_by_edge.get(e.edge, EdgeHealth()).back)
    late = tuple(e.edge for e in pending if e.edge not in back)
    if not late:
        return _confirm_back(rollout, health_by_edge, float("-inf"))
    forced = Event(EventKind.FORCED, f"abort --force: stopped waiting for {', '.join(late)}")
    return _give_up(rollout, back, late, "ended by abort --force", [], (forced,))


def halted(state: RolloutState, wave: int, reason: str) -> Step:
    """A rollout whose step raised (a bug, a damaged row): a moving one is paused -- an
    operator resumes or aborts it -- and the error is recorded with the rollout."""
    events = (Event(EventKind.ERROR, reason),)
    if state in MOVING:
        return Step(RolloutState.PAUSED, wave, events=events, reason=reason)
    return Step(state, wave, events=events, reason=reason)


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
        elif edge.edge in result.unconfirmed:
            edge = dataclasses.replace(edge, state=EdgeState.UNCONFIRMED)
        edges.append(edge)
    aborted_at = rollout.aborted_at
    if result.state is RolloutState.ABORTED and rollout.state is not RolloutState.ABORTED:
        aborted_at = now
    return dataclasses.replace(
        rollout,
        state=result.state,
        wave=result.wave,
        edges=tuple(edges),
        reason=rollout.reason if result.reason is None else result.reason,
        aborted_at=aborted_at,
    )


def _moving_state(wave: int) -> RolloutState:
    if wave < 0:
        return RolloutState.PENDING
    return RolloutState.CANARY if wave == 0 else RolloutState.WAVE


def _number(wave: int) -> str:
    return f" {wave}" if wave > 0 else ""

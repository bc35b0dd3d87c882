"""The staged rollout state machine, pure: waves, health windows, aborts, rollbacks."""

import dataclasses

import pytest

from fedge.edge_manager.rollout import machine
from fedge.edge_manager.rollout.machine import (
    EdgeHealth,
    EdgeState,
    EventKind,
    Rollout,
    RolloutState,
)
from fedge.edge_manager.rollout.plan import RolloutError, make_plan
from fedge.edge_manager.rollout.thresholds import moved_config, restored_config
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import Thresholds

EDGES = ["st-01", "st-02", "st-03", "st-04", "st-05"]
WINDOW = 2.0


def new_rollout(abort_if: str = "failed_activation>0,error_rate>0.01") -> Rollout:
    plan = make_plan(
        EDGES, canary=["st-03"], waves="50%,100%", health_window="2s", abort_if=abort_if
    )
    return Rollout("r-1", "inspect:4", plan, RolloutState.PENDING, -1, machine.initial_edges(plan))


def advance(rollout: Rollout, result: machine.Step, now: float) -> Rollout:
    return machine.apply(rollout, result, now)


def settled(
    rollout: Rollout, at: float, *, passed: bool = True, **metrics: float
) -> dict[str, EdgeHealth]:
    """Every moved edge settled at ``at``, reporting ``metrics`` (and, with ``passed``, its
    probation passed at once: the stations' verdicts are tested on their own below)."""
    return {
        e.edge: EdgeHealth(settled_at=at, metrics=dict(metrics), passed_at=at if passed else None)
        for e in rollout.edges
        if e.state is EdgeState.MOVED
    }


def test_a_healthy_rollout_goes_canary_first_wave_by_wave_to_completed() -> None:
    rollout = new_rollout()
    first = machine.step(rollout, {}, now=100.0)
    assert (first.state, first.wave, first.move) == (RolloutState.CANARY, 0, ("st-03",))
    assert [e.kind for e in first.events] == [EventKind.STARTED, EventKind.WAVE, EventKind.MOVED]
    rollout = advance(rollout, first, 100.0)
    assert rollout.label == "canary"

    # The canary has not settled: its window has not started, whatever the clock says.
    assert not machine.step(rollout, {}, now=500.0).move
    # Settled at 101: the window runs until 103.
    assert not machine.step(rollout, settled(rollout, 101.0, failed_activation=0.0), 102.9).move
    second = machine.step(rollout, settled(rollout, 101.0, failed_activation=0.0), 103.0)
    assert (second.state, second.wave, second.move) == (RolloutState.WAVE, 1, ("st-01", "st-02"))
    rollout = advance(rollout, second, 103.0)
    assert rollout.label == "wave 1"

    # Wave 1: one edge settled, one not yet.
    health = settled(rollout, 104.0)
    health["st-02"] = EdgeHealth()
    assert not machine.step(rollout, health, 200.0).move
    third = machine.step(rollout, settled(rollout, 104.0), 106.0)
    assert third.move == ("st-04", "st-05") and third.state is RolloutState.WAVE
    rollout = advance(rollout, third, 106.0)

    done = machine.step(rollout, settled(rollout, 107.0), 109.0)
    assert done.state is RolloutState.COMPLETED and done.finished and not done.move
    rollout = advance(rollout, done, 109.0)
    assert all(e.state is EdgeState.MOVED for e in rollout.edges)
    assert machine.step(rollout, {}, 1000.0).finished


def test_a_tripped_criterion_on_the_canary_rolls_it_back_and_moves_nothing_else() -> None:
    rollout = advance(new_rollout(), machine.step(new_rollout(), {}, 100.0), 100.0)
    bad = machine.step(rollout, settled(rollout, 101.0, error_rate=0.2), 101.5)
    assert bad.state is RolloutState.ABORTED and bad.roll_back == ("st-03",) and not bad.move
    assert not bad.finished
    reason = next(e.detail for e in bad.events if e.kind is EventKind.ABORTED)
    assert reason == "st-03: error_rate=0.2 > 0.01"
    rollout = advance(rollout, bad, 101.5)
    assert [e.edge for e in rollout.edges if e.state is EdgeState.ROLLING_BACK] == ["st-03"]

    # Waits until the edge is back on its previous model and thresholds.
    waiting = machine.step(rollout, {"st-03": EdgeHealth(back=False)}, 102.0)
    assert waiting.state is RolloutState.ABORTED and not waiting.changes
    back = machine.step(rollout, {"st-03": EdgeHealth(back=True)}, 103.0)
    assert back.state is RolloutState.ROLLED_BACK and back.back == ("st-03",) and back.finished
    rollout = advance(rollout, back, 103.0)
    assert {e.edge: e.state for e in rollout.edges}["st-03"] is EdgeState.ROLLED_BACK
    assert {e.state for e in rollout.edges if e.edge != "st-03"} == {EdgeState.WAITING}


def test_an_abort_in_a_later_wave_sends_every_moved_edge_back() -> None:
    rollout = new_rollout("failed_activation>0")
    for now in (100.0, 103.0):
        rollout = advance(rollout, machine.step(rollout, settled(rollout, now - 2.5), now), now)
    assert rollout.label == "wave 1"
    health = settled(rollout, 103.5, failed_activation=0.0)
    health["st-02"] = EdgeHealth(settled_at=103.5, metrics={"failed_activation": 1.0})
    bad = machine.step(rollout, health, 104.0)
    assert set(bad.roll_back) == {"st-01", "st-02", "st-03"}
    assert "st-02: failed_activation=1 > 0" in bad.events[0].detail


def test_missing_metrics_never_trip_a_criterion() -> None:
    rollout = advance(new_rollout("agreement_drop>0.02"), machine.step(new_rollout(), {}, 1.0), 1.0)
    result = machine.step(rollout, settled(rollout, 2.0), 2.5)
    assert result.state is RolloutState.CANARY and not result.changes


def test_pause_holds_the_waves_but_not_the_abort_criteria() -> None:
    rollout = advance(new_rollout(), machine.step(new_rollout(), {}, 100.0), 100.0)
    paused = machine.pause(rollout)
    rollout = advance(rollout, paused, 100.5)
    assert rollout.label == "paused (canary)"
    assert not machine.step(rollout, settled(rollout, 101.0), 500.0).move
    tripped = machine.step(rollout, settled(rollout, 101.0, failed_activation=1.0), 500.0)
    assert tripped.state is RolloutState.ABORTED and tripped.roll_back == ("st-03",)

    resumed = machine.resume(rollout)
    assert resumed.state is RolloutState.CANARY
    rollout = advance(rollout, resumed, 501.0)
    # Paused time counted toward the window: the next wave moves at once.
    assert machine.step(rollout, settled(rollout, 101.0), 501.0).move == ("st-01", "st-02")


def test_operator_abort_before_anything_moved_ends_as_aborted() -> None:
    result = machine.abort(new_rollout(), "by operator")
    assert result.state is RolloutState.ABORTED and result.finished and not result.roll_back


@pytest.mark.parametrize("state", [RolloutState.COMPLETED, RolloutState.ROLLED_BACK])
def test_finished_rollouts_refuse_operator_actions(state: RolloutState) -> None:
    rollout = dataclasses.replace(new_rollout(), state=state)
    for action in (machine.pause, machine.resume, lambda r: machine.abort(r, "x")):
        with pytest.raises(RolloutError, match="r-1 is"):
            action(rollout)


def test_resume_needs_a_paused_rollout() -> None:
    with pytest.raises(RolloutError, match="not paused"):
        machine.resume(new_rollout())


def test_moving_ties_the_recommended_thresholds_to_the_model() -> None:
    current = EdgeConfig(
        "plant-a",
        "st-03",
        4,
        default_threshold=0.7,
        class_thresholds={"scratch": 0.8},
        model="inspect:3",
    )
    moved = moved_config(
        current,
        fleet="plant-a",
        edge="st-03",
        model="inspect:4",
        recommended=Thresholds(0.35, {"scratch": 0.4}),
        now=5.0,
    )
    assert (moved.version, moved.model, moved.default_threshold) == (5, "inspect:4", 0.35)
    assert moved.class_thresholds == {"scratch": 0.4}
    kept = moved_config(
        current, fleet="plant-a", edge="st-03", model="inspect:4", recommended=None, now=5.0
    )
    assert (kept.default_threshold, kept.class_thresholds) == (0.7, {"scratch": 0.8})
    assert kept.model == "inspect:4"

    back = restored_config(
        moved, current, fleet="plant-a", edge="st-03", previous_model="inspect:3", now=6.0
    )
    assert (back.version, back.model, back.default_threshold) == (6, "inspect:3", 0.7)
    assert back.class_thresholds == {"scratch": 0.8}
    # An edge that had no config goes back to the defaults.
    fresh = restored_config(
        moved, None, fleet="plant-a", edge="st-03", previous_model="inspect:3", now=6.0
    )
    assert (fresh.default_threshold, fresh.class_thresholds) == (0.5, {})


def _on_canary(abort_if: str = "error_rate>0.01", activation_timeout: str = "10m") -> Rollout:
    plan = make_plan(
        EDGES,
        canary=["st-03"],
        waves="50%,100%",
        health_window="2s",
        abort_if=abort_if,
        activation_timeout=activation_timeout,
    )
    rollout = Rollout(
        "r-1", "inspect:4", plan, RolloutState.PENDING, -1, machine.initial_edges(plan)
    )
    return advance(rollout, machine.step(rollout, {}, 100.0), 100.0)


def test_a_failed_activation_aborts_even_when_abort_if_leaves_it_out() -> None:
    rollout = _on_canary("error_rate>0.01")
    failed = {"st-03": EdgeHealth(settled_at=101.0, failed=True)}
    # It settled (as failed) and its window is over: it must not count as healthy.
    result = machine.step(rollout, failed, 200.0)
    assert result.state is RolloutState.ABORTED and result.roll_back == ("st-03",)
    assert not result.move
    assert result.reason == "st-03: failed_activation=1 (a failed activation always aborts)"


def test_an_edge_that_never_settles_counts_as_a_failed_activation() -> None:
    rollout = _on_canary(activation_timeout="10m")
    assert not machine.step(rollout, {}, 100.0 + 599.0).changes  # still waiting
    result = machine.step(rollout, {}, 100.0 + 600.0)
    assert result.state is RolloutState.ABORTED and result.roll_back == ("st-03",)
    assert result.reason == (
        "st-03: failed_activation=1 (not settled within the 600s activation timeout)"
    )
    # Settled in time: no timeout, the window runs as usual.
    assert not machine.step(rollout, {"st-03": EdgeHealth(settled_at=650.0)}, 700.0).roll_back


def test_edges_that_never_confirm_the_rollback_end_the_rollout_past_its_deadline() -> None:
    rollout = new_rollout("failed_activation>0")
    for now in (100.0, 103.0):
        rollout = advance(rollout, machine.step(rollout, settled(rollout, now - 2.5), now), now)
    aborted = machine.abort(rollout, "by operator")
    rollout = advance(rollout, aborted, 110.0)
    assert rollout.aborted_at == 110.0 and rollout.reason == "by operator"
    # st-01 confirms; st-02 and st-03 are offline and never do.
    health = {"st-01": EdgeHealth(back=True), "st-02": EdgeHealth(), "st-03": EdgeHealth()}
    waiting = machine.step(rollout, health, 110.0 + 599.0)
    assert waiting.state is RolloutState.ABORTED and not waiting.finished
    rollout = advance(rollout, waiting, 110.0 + 599.0)
    ended = machine.step(rollout, health, 110.0 + 600.0)
    assert ended.state is RolloutState.ROLLED_BACK and ended.finished
    assert ended.unconfirmed == ("st-02", "st-03")
    assert ended.reason == (
        "by operator; not confirmed back: st-02, st-03 (did not confirm the previous model "
        "within the 600s rollback timeout)"
    )
    assert [(e.kind, e.edge) for e in ended.events if e.edge] == [
        (EventKind.UNCONFIRMED, "st-02"),
        (EventKind.UNCONFIRMED, "st-03"),
    ]
    states = {e.edge: e.state for e in advance(rollout, ended, 710.0).edges}
    assert states["st-01"] is EdgeState.ROLLED_BACK
    assert states["st-02"] is states["st-03"] is EdgeState.UNCONFIRMED


def test_abort_force_ends_an_aborted_rollout_that_waits_for_edges() -> None:
    rollout = _on_canary()
    rollout = advance(rollout, machine.abort(rollout, "by operator"), 101.0)
    with pytest.raises(RolloutError, match=r"already aborted and waits for st-03.*--force"):
        machine.abort(rollout, "again")
    forced = machine.force_finish(rollout, {"st-03": EdgeHealth()})
    assert forced.state is RolloutState.ROLLED_BACK and forced.finished
    assert forced.unconfirmed == ("st-03",)
    assert forced.events[0].kind is EventKind.FORCED
    assert forced.reason is not None and "ended by abort --force" in forced.reason
    # Confirmed meanwhile: --force just records it as back.
    confirmed = machine.force_finish(rollout, {"st-03": EdgeHealth(back=True)})
    assert confirmed.back == ("st-03",) and not confirmed.unconfirmed and confirmed.finished
    with pytest.raises(RolloutError, match="--force ends an aborted rollout"):
        machine.force_finish(_on_canary(), {})


def test_a_rollout_whose_step_fails_is_paused_with_the_reason() -> None:
    stopped = machine.halted(RolloutState.WAVE, 2, "KeyError: 'x'")
    assert (stopped.state, stopped.wave, stopped.reason) == (
        RolloutState.PAUSED,
        2,
        "KeyError: 'x'",
    )
    assert [(e.kind, e.detail) for e in stopped.events] == [(EventKind.ERROR, "KeyError: 'x'")]
    # An aborted one keeps rolling back (pausing it would let resume move edges again).
    assert machine.halted(RolloutState.ABORTED, 1, "x").state is RolloutState.ABORTED


# -- the stations' own probation verdicts (issue 32, item 1)


def _canary_settled() -> Rollout:
    rollout = new_rollout()
    return advance(rollout, machine.step(rollout, {}, 100.0), 100.0)


def test_a_wave_waits_for_every_station_to_pass_its_probation() -> None:
    rollout = _canary_settled()
    # Settled at 101 and the window is over at 103, but the canary's verdict is out.
    waiting = machine.step(rollout, settled(rollout, 101.0, passed=False), 150.0)
    assert waiting.state is RolloutState.CANARY and not waiting.move and not waiting.events
    passed = {"st-03": EdgeHealth(settled_at=101.0, passed_at=140.0)}
    moved = machine.step(rollout, passed, 150.0)
    assert moved.state is RolloutState.WAVE and moved.move == ("st-01", "st-02")


def test_no_verdict_within_the_probation_timeout_aborts() -> None:
    plan = dataclasses.replace(new_rollout().plan, probation_timeout_s=60.0)
    rollout = dataclasses.replace(_canary_settled(), plan=plan)
    quiet = settled(rollout, 101.0, passed=False)
    assert machine.step(rollout, quiet, 160.9).state is RolloutState.CANARY
    late = machine.step(rollout, quiet, 161.0)
    assert late.state is RolloutState.ABORTED and late.roll_back == ("st-03",)
    assert "st-03: probation_timeout (no probation verdict within 60s" in str(late.reason)


def test_a_plan_that_does_not_wait_completes_on_the_health_window_alone() -> None:
    plan = dataclasses.replace(new_rollout().plan, wait_for_probation=False)
    rollout = dataclasses.replace(_canary_settled(), plan=plan)
    quiet = settled(rollout, 101.0, passed=False)
    assert machine.step(rollout, quiet, 103.0).move == ("st-01", "st-02")
    # ... and the missing verdict never times out: it is not asked for.
    assert machine.step(rollout, quiet, 10_000.0).state is RolloutState.WAVE


def test_a_station_rolling_back_after_completion_degrades_the_rollout() -> None:
    done = dataclasses.replace(
        _canary_settled(),
        state=RolloutState.COMPLETED,
        edges=tuple(dataclasses.replace(e, state=EdgeState.MOVED) for e in new_rollout().edges),
    )
    result = machine.degrade(done, {"st-04": "error rate 0.2 > 0.05"})
    assert result.state is RolloutState.DEGRADED and result.finished and not result.roll_back
    (event,) = result.events
    assert (event.kind, event.edge) == (EventKind.DEGRADED, "st-04")
    assert "error rate 0.2" in event.detail and "st-04" in str(result.reason)
    degraded = machine.apply(done, result, 500.0)
    assert machine.step(degraded, {}, 600.0).finished  # nothing moves by itself
    # An operator resolves it: abort sends every moved edge back to its previous model.
    back = machine.abort(degraded, "by operator")
    assert back.state is RolloutState.ABORTED and set(back.roll_back) == set(EDGES)
    with pytest.raises(RolloutError, match="only a completed one degrades"):
        machine.degrade(degraded, {"st-04": "again"})

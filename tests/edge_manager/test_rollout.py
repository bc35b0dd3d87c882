"""The staged rollout state machine, pure: waves, health windows, aborts, rollbacks."""

import dataclasses

import pytest

from fedge.edge_manager import rollout as machine
from fedge.edge_manager.rollout import (
    EdgeHealth,
    EdgeState,
    EventKind,
    Rollout,
    RolloutState,
    moved_config,
    restored_config,
)
from fedge.edge_manager.rollout_plan import RolloutError, make_plan
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


def settled(rollout: Rollout, at: float, **metrics: float) -> dict[str, EdgeHealth]:
    """Every moved edge settled at ``at``, reporting ``metrics``."""
    return {
        e.edge: EdgeHealth(settled_at=at, metrics=dict(metrics))
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

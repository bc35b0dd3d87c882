"""Round planning (over-selection, quorum, deadline) and settling a round."""

import random

import numpy as np
import pytest

from fedge.aggregator.rounds.deadline import RoundPlan, plan_round, settle


def _plan(
    candidates: list[int],
    per_round: int,
    *,
    over_selection: float = 0.0,
    quorum_fraction: float = 1.0,
    expected_latency_s: float | None = None,
    deadline_factor: float = 1.0,
    seed: int = 0,
) -> RoundPlan:
    return plan_round(
        candidates,
        per_round,
        over_selection=over_selection,
        quorum_fraction=quorum_fraction,
        expected_latency_s=expected_latency_s,
        deadline_factor=deadline_factor,
        rng=np.random.default_rng(seed),
    )


# ---------------------------------------------------------------- plan_round


@pytest.mark.parametrize(
    ("per_round", "over_selection", "expected"),
    [(5, 0.0, 5), (5, 0.3, 7), (10, 0.1, 11), (10, 0.3, 13), (4, 0.5, 6), (3, 1.0, 6)],
)
def test_over_selection_counts(per_round: int, over_selection: float, expected: int) -> None:
    plan = _plan(list(range(100)), per_round, over_selection=over_selection)
    assert len(plan.selected) == expected
    assert len(set(plan.selected)) == expected
    assert set(plan.selected) <= set(range(100))


def test_selection_is_capped_by_candidates() -> None:
    plan = _plan([7, 8, 9], 5, over_selection=0.3, quorum_fraction=1.0)
    assert sorted(plan.selected) == [7, 8, 9]
    assert plan.quorum == 3


@pytest.mark.parametrize(
    ("per_round", "fraction", "expected"),
    [(5, 1.0, 5), (5, 0.8, 4), (10, 0.7, 7), (5, 0.5, 3), (5, 0.01, 1)],
)
def test_quorum_is_a_ceiling_of_per_round(per_round: int, fraction: float, expected: int) -> None:
    plan = _plan(list(range(50)), per_round, over_selection=0.3, quorum_fraction=fraction)
    assert plan.quorum == expected


def test_deadline_is_expected_latency_times_factor() -> None:
    assert _plan([1, 2], 1, expected_latency_s=4.0, deadline_factor=1.5).deadline_s == 6.0
    assert _plan([1, 2], 1, expected_latency_s=None, deadline_factor=1.5).deadline_s is None


def test_selection_is_deterministic_for_a_seed_and_plain_ints() -> None:
    first = _plan(list(range(30)), 5, seed=4)
    assert first == _plan(list(range(30)), 5, seed=4)
    assert all(type(p) is int for p in first.selected)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"over_selection": -0.1},
        {"quorum_fraction": 0.0},
        {"quorum_fraction": 1.5},
        {"deadline_factor": 0.0},
        {"expected_latency_s": -1.0},
    ],
)
def test_bad_settings_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        _plan(list(range(10)), 3, **kwargs)  # type: ignore[arg-type]


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError, match="no candidates"):
        _plan([], 3)


# ---------------------------------------------------------------- settle


def test_quorum_reached_before_the_deadline() -> None:
    plan = RoundPlan(selected=(1, 2, 3, 4, 5), quorum=3, deadline_s=10.0)
    settlement = settle(plan, {1: 4.0, 2: 1.0, 3: 12.0, 4: 2.0, 5: 6.0})
    assert settlement.on_time == (2, 4, 1)
    assert settlement.late == (5, 3)
    assert settlement.failed == ()
    assert settlement.round_time_s == 4.0
    assert settlement.quorum_met


def test_deadline_before_quorum() -> None:
    plan = RoundPlan(selected=(1, 2, 3, 4), quorum=3, deadline_s=5.0)
    settlement = settle(plan, {1: 1.0, 2: 7.0, 3: 5.0, 4: 9.0})
    assert settlement.on_time == (1, 3)  # a reply at the deadline is on time
    assert settlement.late == (2, 4)
    assert settlement.round_time_s == 5.0
    assert not settlement.quorum_met


def test_failures_are_reported_in_selection_order() -> None:
    plan = RoundPlan(selected=(9, 8, 7, 6), quorum=2, deadline_s=10.0)
    settlement = settle(plan, {9: None, 8: 3.0, 7: None})  # 6 is missing: failed too
    assert settlement.failed == (9, 7, 6)
    assert settlement.on_time == (8,)
    assert settlement.round_time_s == 10.0  # short of quorum: waits for the deadline
    assert not settlement.quorum_met


def test_no_deadline_ends_at_the_kth_arrival() -> None:
    plan = RoundPlan(selected=(1, 2, 3), quorum=2, deadline_s=None)
    settlement = settle(plan, {1: 30.0, 2: 10.0, 3: 20.0})
    assert settlement.on_time == (2, 3)
    assert settlement.late == (1,)
    assert settlement.round_time_s == 20.0
    assert settlement.quorum_met


def test_quorum_larger_than_arrivals_without_deadline_ends_at_the_last_arrival() -> None:
    plan = RoundPlan(selected=(1, 2, 3, 4), quorum=4, deadline_s=None)
    settlement = settle(plan, {1: 3.0, 2: None, 3: 8.0, 4: None})
    assert settlement.on_time == (1, 3)
    assert settlement.late == ()
    assert settlement.failed == (2, 4)
    assert settlement.round_time_s == 8.0
    assert not settlement.quorum_met


def test_nobody_replies() -> None:
    plan = RoundPlan(selected=(1, 2), quorum=1, deadline_s=None)
    assert settle(plan, {1: None, 2: None}).round_time_s == 0.0
    with_deadline = RoundPlan(selected=(1, 2), quorum=1, deadline_s=4.0)
    assert settle(with_deadline, {}).round_time_s == 4.0


def test_ties_at_the_kth_arrival_are_all_on_time() -> None:
    plan = RoundPlan(selected=(1, 2, 3), quorum=1, deadline_s=None)
    settlement = settle(plan, {3: 2.0, 1: 2.0, 2: 5.0})
    assert settlement.on_time == (1, 3)  # same instant: selection order
    assert settlement.late == (2,)


def test_settle_rejects_unknown_parties_and_bad_times() -> None:
    plan = RoundPlan(selected=(1, 2), quorum=1, deadline_s=None)
    with pytest.raises(ValueError, match="not selected"):
        settle(plan, {3: 1.0})
    with pytest.raises(ValueError, match="party 1"):
        settle(plan, {1: -1.0})


def test_round_plan_validates() -> None:
    with pytest.raises(ValueError, match="quorum"):
        RoundPlan(selected=(1, 2), quorum=3, deadline_s=None)
    with pytest.raises(ValueError, match="repeat"):
        RoundPlan(selected=(1, 1), quorum=1, deadline_s=None)


def test_settle_invariants_on_random_rounds() -> None:
    rand = random.Random(0)
    for _ in range(200):
        n = rand.randint(1, 12)
        selected = tuple(rand.sample(range(100), n))
        quorum = rand.randint(1, n)
        deadline = rand.choice([None, rand.uniform(0.0, 10.0)])
        arrivals: dict[int, float | None] = {
            p: rand.choice([None, rand.uniform(0.0, 12.0), float(rand.randint(0, 12))])
            for p in selected
        }
        plan = RoundPlan(selected, quorum, deadline)
        result = settle(plan, arrivals)
        groups = (set(result.on_time), set(result.late), set(result.failed))
        assert set().union(*groups) == set(selected)
        assert sum(len(g) for g in groups) == n  # pairwise disjoint
        assert len(result.on_time) + len(result.late) + len(result.failed) == n
        if deadline is not None:
            assert result.round_time_s <= deadline
        assert result.quorum_met == (len(result.on_time) >= quorum)
        on_time_at = [arrivals[p] for p in result.on_time]
        assert on_time_at == sorted(on_time_at)  # type: ignore[type-var]
        assert all(t is not None and t <= result.round_time_s for t in on_time_at)
        assert all((t := arrivals[p]) is not None and t > result.round_time_s for p in result.late)

"""TiFL's pure core: latency profiles, tiers, ChangeProbs, Algorithm 2, Eq. 5."""

import json
import math
from collections import Counter
from dataclasses import asdict, replace

import numpy as np
import pytest

from fedge.aggregator.rounds.latency import LatencyProfile, mean_latencies, observe, observe_timeout
from fedge.aggregator.tiers.groups import Tiers, form_tiers
from fedge.aggregator.tiers.selection import (
    TierSelectionState,
    adaptive_probabilities,
    choose_tier,
    default_credits,
    estimated_training_time,
    initial_state,
    maybe_update_probabilities,
    record_tier_accuracy,
)

# ---------------------------------------------------------------- profiles


def test_first_observation_is_the_mean() -> None:
    assert observe(None, 2.0) == LatencyProfile(mean_s=2.0, count=1, last_s=2.0, timeouts=0)


def test_observation_is_an_ewma() -> None:
    profile = observe(observe(None, 10.0), 20.0, alpha=0.3)
    assert profile.mean_s == pytest.approx(13.0)
    assert (profile.count, profile.last_s, profile.timeouts) == (2, 20.0, 0)


def test_timeout_adds_t_max_and_counts() -> None:
    profile = observe_timeout(observe(None, 1.0), 11.0, alpha=0.5)
    assert profile.mean_s == pytest.approx(6.0)
    assert (profile.count, profile.last_s, profile.timeouts) == (2, 11.0, 1)


def test_a_party_that_always_times_out_stays_at_t_max() -> None:
    profile = None
    for _ in range(50):
        profile = observe_timeout(profile, 7.3)
    assert profile is not None
    assert profile.mean_s == 7.3
    assert profile.timeouts == 50
    tiers = form_tiers({1: 1.0, 2: profile.mean_s}, 1, dropout_threshold_s=7.3)
    assert tiers.dropouts == (2,)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_latency_is_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="latency_s"):
        observe(None, bad)


def test_bad_alpha_is_rejected() -> None:
    with pytest.raises(ValueError, match="alpha"):
        observe(observe(None, 1.0), 1.0, alpha=0.0)


def test_mean_latencies() -> None:
    assert mean_latencies({4: observe(None, 2.5)}) == {4: 2.5}


# ---------------------------------------------------------------- tiers


def test_even_tiers_fastest_first() -> None:
    latencies = {10: 5.0, 11: 1.0, 12: 3.0, 13: 2.0, 14: 6.0, 15: 4.0}
    tiers = form_tiers(latencies, 3)
    assert tiers.members == ((11, 13), (12, 15), (10, 14))
    assert tiers.dropouts == ()
    assert tiers.n_tiers == 3


def test_uneven_tiers_are_balanced_larger_first() -> None:
    latencies = {p: float(p) for p in range(7)}
    assert form_tiers(latencies, 3).members == ((0, 1, 2), (3, 4), (5, 6))
    # fltk's ceil chunks would give 2+2+1 = 3 tiers for 4 asked; we give 4.
    five = form_tiers({p: float(p) for p in range(5)}, 4)
    assert [len(t) for t in five.members] == [2, 1, 1, 1]


def test_fewer_parties_than_tiers() -> None:
    assert form_tiers({1: 2.0, 2: 1.0}, 5).members == ((2,), (1,))
    assert form_tiers({}, 3).members == ()


def test_a_minimum_tier_size_makes_fewer_tiers_never_smaller_ones() -> None:
    # Under SecAgg+ a tier holds at least 3 parties (issue 24): a pair would learn each
    # other's update from their sum.
    six = {p: float(p) for p in range(6)}
    assert form_tiers(six, 2, min_size=3).members == ((0, 1, 2), (3, 4, 5))
    assert form_tiers(six, 3, min_size=3).members == ((0, 1, 2), (3, 4, 5))
    seven = form_tiers({p: float(p) for p in range(7)}, 5, min_size=3)
    assert [len(t) for t in seven.members] == [4, 3]
    # Fewer parties than the minimum: one tier of them all (the round refuses to run).
    assert form_tiers({1: 1.0, 2: 2.0}, 2, min_size=3).members == ((1, 2),)
    assert form_tiers({}, 2, min_size=3).members == ()
    with pytest.raises(ValueError, match="min_size"):
        form_tiers(six, 2, min_size=0)


def test_ties_break_by_party_id() -> None:
    assert form_tiers({3: 1.0, 1: 1.0, 2: 1.0}, 3).members == ((1,), (2,), (3,))


def test_dropouts_at_or_above_threshold_are_excluded() -> None:
    latencies = {1: 1.0, 2: 10.0, 3: 2.0, 4: 12.0, 5: 3.0}
    tiers = form_tiers(latencies, 2, dropout_threshold_s=10.0)
    assert tiers.members == ((1, 3), (5,))
    assert tiers.dropouts == (2, 4)
    assert tiers.tier_of(5) == 1
    assert tiers.tier_of(2) is None
    assert tiers.tier_of(99) is None


def test_tier_latency_stats() -> None:
    latencies = {p: float(p) for p in range(1, 12)}
    tiers = form_tiers(latencies, 1)
    assert tiers.latency_p90(0, latencies) == pytest.approx(10.0)
    assert tiers.latency_max(0, latencies) == 11.0
    with pytest.raises(ValueError, match="no latency"):
        tiers.latency_p90(0, {1: 1.0})


def test_tiers_reject_overlap() -> None:
    with pytest.raises(ValueError, match="more than one tier"):
        Tiers(((1, 2), (2, 3)))
    with pytest.raises(ValueError, match="dropout"):
        Tiers(((1,),), dropouts=(1,))


def test_nan_latency_is_rejected() -> None:
    with pytest.raises(ValueError, match="party 3"):
        form_tiers({3: math.nan}, 1)


# ---------------------------------------------------------------- ChangeProbs


def test_literal_three_tiers() -> None:
    probabilities = adaptive_probabilities([0.9, 0.5, 0.7], [1, 1, 1])
    assert probabilities == pytest.approx((1 / 6, 3 / 6, 2 / 6))


def test_probabilities_sum_to_one_and_lowest_accuracy_wins() -> None:
    rng = np.random.default_rng(3)
    for n in range(1, 9):
        accuracies = rng.random(n).tolist()
        probabilities = adaptive_probabilities(accuracies, [5] * n)
        assert math.fsum(probabilities) == pytest.approx(1.0)
        assert int(np.argmax(probabilities)) == int(np.argmin(accuracies))
        assert int(np.argmin(probabilities)) == int(np.argmax(accuracies))


def test_tiers_without_credit_get_zero() -> None:
    probabilities = adaptive_probabilities([0.1, 0.2, 0.3, 0.4], [0, 2, None, 0])
    assert probabilities == pytest.approx((0.0, 2 / 3, 1 / 3, 0.0))


def test_no_credit_anywhere_is_an_error() -> None:
    with pytest.raises(ValueError, match="credit"):
        adaptive_probabilities([0.1, 0.2], [0, 0])


def test_equal_accuracies_favour_the_faster_tier() -> None:
    assert adaptive_probabilities([0.5, 0.5], [1, 1]) == pytest.approx((2 / 3, 1 / 3))


# ---------------------------------------------------------------- selection state


def test_initial_state_is_uniform_and_adaptive() -> None:
    state = initial_state(4, 3)
    assert state.probabilities == (0.25,) * 4
    assert state.credits == (3,) * 4
    assert state.adaptive
    assert state.accuracy_history == ((),) * 4


def test_default_credits_cover_the_run() -> None:
    assert default_credits(100, 3) == 34


def test_credits_decrement_and_an_exhausted_tier_is_never_chosen() -> None:
    state = initial_state(3, [2, 0, 50])
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(40):
        tier, state = choose_tier(state, rng)
        chosen.append(tier)
    counts = Counter(chosen)
    assert counts[0] == 2
    assert counts[1] == 0
    assert counts[2] == 38
    assert state.credits == (0, 0, 12)
    assert state.current_tier == chosen[-1]


def test_choosing_with_no_credit_left_is_an_error() -> None:
    state = initial_state(2, 1)
    rng = np.random.default_rng(0)
    _, state = choose_tier(state, rng)
    _, state = choose_tier(state, rng)
    with pytest.raises(ValueError, match="credits"):
        choose_tier(state, rng)


def test_static_selection_follows_fixed_probabilities_with_unlimited_credit() -> None:
    state = initial_state(5, None, static_probabilities=[0.7, 0.1, 0.1, 0.05, 0.05])
    assert not state.adaptive
    rng = np.random.default_rng(1)
    counts: Counter[int] = Counter()
    for _ in range(4000):
        tier, state = choose_tier(state, rng)
        counts[tier] += 1
    assert state.credits == (None,) * 5
    assert counts[0] / 4000 == pytest.approx(0.7, abs=0.03)
    fast = initial_state(3, None, static_probabilities=[1.0, 0.0, 0.0])
    assert {choose_tier(fast, rng)[0] for _ in range(50)} == {0}


def test_zero_probability_tiers_are_a_fallback_once_the_others_are_spent() -> None:
    state = initial_state(2, [1, 5], static_probabilities=[1.0, 0.0])
    rng = np.random.default_rng(0)
    first, state = choose_tier(state, rng)
    second, state = choose_tier(state, rng)
    assert (first, second) == (0, 1)


def test_static_probabilities_must_sum_to_one() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        initial_state(2, None, static_probabilities=[0.5, 0.6])


def test_record_accuracy_appends_and_replaces_the_same_round() -> None:
    state = initial_state(2, 5)
    state = record_tier_accuracy(state, 1, 0.5, 3)
    state = record_tier_accuracy(state, 1, 0.6, 3)
    state = record_tier_accuracy(state, 1, 0.7, 4)
    assert state.accuracy_history == ((), (0.6, 0.7))
    assert state.accuracy_rounds == ((), (3, 4))
    assert state.accuracy_at(1, 3) == 0.6
    assert state.accuracy_at(1, 2) is None
    with pytest.raises(ValueError, match="round order"):
        record_tier_accuracy(state, 1, 0.8, 2)


def test_maybe_update_changes_only_at_the_interval_when_not_improved() -> None:
    state = initial_state(3, 100)
    state = record_tier_accuracy(state, 1, 0.9, 5)
    state = record_tier_accuracy(state, 2, 0.4, 5)
    state = record_tier_accuracy(state, 0, 0.6, 5)
    state = record_tier_accuracy(state, 0, 0.6, 10)  # no better than 5 rounds ago
    state = _with_current_tier(state, 0)
    # Not at the interval: unchanged even though tier 0 stalled.
    for r in (1, 4, 9, 11):
        assert maybe_update_probabilities(state, r, 5) is state
    updated = maybe_update_probabilities(state, 10, 5)
    # ChangeProbs over A^10 = (0.6, 0.9, 0.4): tier 2 lowest, then 0, then 1.
    assert updated.probabilities == pytest.approx((2 / 6, 1 / 6, 3 / 6))
    assert updated.last_change_round == 10


def test_maybe_update_keeps_probabilities_when_the_tier_improved() -> None:
    state = initial_state(3, 100)
    state = record_tier_accuracy(state, 0, 0.6, 5)
    state = record_tier_accuracy(state, 0, 0.65, 10)
    state = _with_current_tier(state, 0)
    assert maybe_update_probabilities(state, 10, 5) is state


def test_maybe_update_not_before_the_first_interval_nor_for_static_states() -> None:
    state = _with_current_tier(record_tier_accuracy(initial_state(2, 9), 0, 0.5, 1), 0)
    assert maybe_update_probabilities(state, 0, 5) is state
    # With a baseline only from round 1, round 5 compares 0.5 <= 0.5: stalled.
    assert maybe_update_probabilities(state, 5, 5).last_change_round == 5
    static = initial_state(2, None, static_probabilities=[0.5, 0.5])
    static = _with_current_tier(record_tier_accuracy(static, 0, 0.5, 1), 0)
    assert maybe_update_probabilities(static, 5, 5) is static


def test_unmeasured_tiers_count_as_least_accurate() -> None:
    state = initial_state(3, 10)
    state = record_tier_accuracy(state, 0, 0.8, 2)
    state = record_tier_accuracy(state, 1, 0.7, 2)
    state = _with_current_tier(state, 0)
    updated = maybe_update_probabilities(state, 4, 2)
    assert updated.probabilities == pytest.approx((1 / 6, 2 / 6, 3 / 6))


def test_maybe_update_without_a_chosen_tier_does_nothing() -> None:
    state = record_tier_accuracy(initial_state(2, 9), 0, 0.5, 1)
    assert maybe_update_probabilities(state, 10, 5) is state


def _with_current_tier(state: TierSelectionState, tier: int) -> TierSelectionState:
    return replace(state, current_tier=tier)


def test_state_and_tiers_survive_a_json_round_trip() -> None:
    state = initial_state(3, [2, None, 4])
    state = record_tier_accuracy(state, 1, 0.5, 3)
    _, state = choose_tier(state, np.random.default_rng(0))
    state = replace(state, last_change_round=3)
    assert TierSelectionState.from_dict(json.loads(json.dumps(asdict(state)))) == state
    tiers = form_tiers({1: 1.0, 2: 2.0, 3: 9.0}, 2, dropout_threshold_s=5.0)
    assert Tiers.from_dict(json.loads(json.dumps(asdict(tiers)))) == tiers


# ---------------------------------------------------------------- Eq. 5


def test_estimated_training_time_literal() -> None:
    # 100 * (1 * 0.5 + 2 * 0.3 + 10 * 0.2) = 310
    assert estimated_training_time(100, [1.0, 2.0, 10.0], [0.5, 0.3, 0.2]) == pytest.approx(310.0)
    assert estimated_training_time(500, [4.0, 9.0], [1.0, 0.0]) == pytest.approx(2000.0)


def test_estimated_training_time_needs_matching_lengths() -> None:
    with pytest.raises(ValueError, match="2 tier latencies but 1"):
        estimated_training_time(1, [1.0, 2.0], [1.0])

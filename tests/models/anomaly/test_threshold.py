"""A station's anomaly threshold for a target false-alarm rate: conformal, so a new good
part exceeds it with probability at most the rate."""

import numpy as np
import pytest

from fedge.models.anomaly import StatisticsError
from fedge.models.anomaly.statistics import fit, mahalanobis, station_statistics
from fedge.models.anomaly.threshold import (
    TooFewPartsError,
    conformal_rank,
    leave_one_out_scores,
    min_parts_for,
    threshold_for_rate,
)


def test_the_threshold_is_the_conformal_order_statistic() -> None:
    scores = np.arange(1, 1001, dtype=np.float64)  # 1..1000
    result = threshold_for_rate(scores, 0.01)
    # k = ceil(1001 * 0.99) = 991: the empirical 99 % quantile (990) would be exceeded by
    # a new part with probability 11/1001 > 1 %.
    assert result.threshold == 991.0
    assert result.false_alarms == 9
    assert result.parts == 1000
    assert result.false_alarm_bound == pytest.approx(10 / 1001)
    assert result.false_alarm_bound <= 0.01


@pytest.mark.parametrize(("rate", "needed"), [(0.01, 99), (0.05, 19), (0.1, 9), (0.2, 4), (0.5, 1)])
def test_the_fewest_parts_for_a_rate(rate: float, needed: int) -> None:
    assert min_parts_for(rate) == needed
    assert conformal_rank(needed, rate) <= needed  # enough
    if needed > 1:
        assert conformal_rank(needed - 1, rate) > needed - 1  # one fewer is not
    scores = np.random.default_rng(0).gamma(2.0, size=needed)
    assert threshold_for_rate(scores, rate).threshold == scores.max()


def test_too_few_parts_set_no_threshold_and_say_how_many_are_needed() -> None:
    scores = np.random.default_rng(0).gamma(2.0, size=4)
    with pytest.raises(TooFewPartsError, match=r"4 good part.*out of sample.*needs at least 19"):
        threshold_for_rate(scores, 0.05)
    assert threshold_for_rate(scores, 0.2).threshold == scores.max()


def test_new_good_parts_exceed_it_at_most_at_the_rate_on_average() -> None:
    # The guarantee is over the held-out draw: 20 parts at 5 %, repeated.
    rng = np.random.default_rng(1)
    exceeded = []
    for _ in range(4000):
        held, new = rng.gamma(2.0, size=20), rng.gamma(2.0)
        exceeded.append(new > threshold_for_rate(held, 0.05).threshold)
    # exactly 1/21 = 0.0476 in expectation; the old empirical rule gave the same k here
    # but 2/101 for 100 parts at 1 %.
    assert float(np.mean(exceeded)) == pytest.approx(1 / 21, abs=0.012)


@pytest.mark.parametrize("rate", [0.0, 1.0, -0.1])
def test_a_rate_outside_zero_one_is_refused(rate: float) -> None:
    with pytest.raises(StatisticsError, match="false-alarm rate"):
        threshold_for_rate(np.ones(10), rate)


def test_no_held_out_parts_is_an_error() -> None:
    with pytest.raises(StatisticsError, match="no held-out"):
        threshold_for_rate(np.zeros(0), 0.01)


def test_a_part_left_out_scores_as_under_the_fit_of_the_others() -> None:
    rng = np.random.default_rng(2)
    parts = rng.normal(size=(30, 4, 3))  # 30 parts, 4 locations, 3 features
    pooled = station_statistics(parts, (2, 2))
    mine = parts[:5]  # this station's parts, among the 30
    scores = leave_one_out_scores(pooled, mine)
    for index, part in enumerate(mine):
        others = station_statistics(np.delete(parts, index, axis=0), (2, 2))
        expected = mahalanobis(fit(others), part[None]).max()
        assert scores[index] == pytest.approx(expected, rel=1e-9)
    # Out of sample: higher than in the fit that holds them.
    assert np.all(scores > mahalanobis(fit(pooled), mine).max(axis=1))


def test_leaving_out_more_parts_than_the_fit_can_spare_is_refused() -> None:
    parts = np.random.default_rng(3).normal(size=(3, 4, 3))
    pooled = station_statistics(parts, (2, 2))
    with pytest.raises(StatisticsError, match="cannot each be left out"):
        leave_one_out_scores(pooled, np.concatenate([parts, parts[:1]]))
    with pytest.raises(StatisticsError, match="like the fit's"):
        leave_one_out_scores(pooled, parts[:, :, :2])

"""A station's anomaly threshold for a target false-alarm rate."""

import numpy as np
import pytest

from fedge.models.anomaly import StatisticsError
from fedge.models.anomaly.threshold import threshold_for_rate


def test_one_percent_of_held_out_good_parts_score_above_the_threshold() -> None:
    scores = np.arange(1, 1001, dtype=np.float64)  # 1..1000
    result = threshold_for_rate(scores, 0.01)
    assert result.threshold == 990.0
    assert result.held_out_false_alarms == 10
    assert result.held_out_parts == 1000


def test_few_parts_give_the_largest_score_and_never_more_false_alarms() -> None:
    scores = np.random.default_rng(0).gamma(2.0, size=37)
    result = threshold_for_rate(scores, 0.01)
    assert result.threshold == scores.max()
    assert result.held_out_false_alarms == 0
    for rate in (0.05, 0.1, 0.3):
        assert threshold_for_rate(scores, rate).held_out_false_alarms <= rate * 37


@pytest.mark.parametrize("rate", [0.0, 1.0, -0.1])
def test_a_rate_outside_zero_one_is_refused(rate: float) -> None:
    with pytest.raises(StatisticsError, match="false-alarm rate"):
        threshold_for_rate(np.ones(10), rate)


def test_no_held_out_parts_is_an_error() -> None:
    with pytest.raises(StatisticsError, match="no held-out"):
        threshold_for_rate(np.zeros(0), 0.01)

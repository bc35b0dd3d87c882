"""Adding station statistics: each station once, failures kept, nothing to fit is an error."""

import numpy as np
import pytest

from fedge.aggregator.anomaly.combine import NoStatisticsError, StationReply, combine
from fedge.models.anomaly.statistics import SufficientStatistics, fit, station_statistics

GRID = (1, 2)


def _stats(n: int, seed: int) -> SufficientStatistics:
    return station_statistics(np.random.default_rng(seed).normal(size=(n, 2, 3)), GRID)


def test_each_station_counts_once_and_failures_are_data() -> None:
    a, b = _stats(5, 1), _stats(7, 2)
    replies = [
        StationReply(1, "st-01", a),
        StationReply(2, "st-02", b),
        StationReply(1, "st-01", a),  # a retried message: not added twice
        StationReply(3, "st-03", None, "station st-03 has no good parts to contribute"),
    ]
    fleet = combine(replies)
    assert fleet.counts == {"st-01": 5, "st-02": 7}
    assert fleet.summed.count == 12
    assert fleet.duplicates == ("st-01",)
    assert "no good parts" in fleet.failures["st-03"]
    pooled = fit(station_statistics(np.concatenate([_raw(5, 1), _raw(7, 2)]), GRID))
    np.testing.assert_allclose(fleet.model.covariance, pooled.covariance, atol=1e-12)


def _raw(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 2, 3))


def test_no_statistics_at_all_is_an_error_naming_the_failures() -> None:
    with pytest.raises(NoStatisticsError, match="st-09"):
        combine([StationReply(9, "st-09", None, "no good parts")])

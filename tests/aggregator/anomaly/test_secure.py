"""SecAgg+ for anomaly statistics: ranges from the clip, and the fit within the stated bound.

The quantisation is Flower's own (``flwr.common.secure_aggregation.quantization``), applied
as ``secaggplus_mod`` and ``SecAggPlusWorkflow`` apply it (scale by the quantised weight,
quantise, add, dequantise, shift, divide): what SecAgg+ unmasks without the masks, which
cancel exactly. The real protocol on real SuperNodes is
``tests/federation/test_anomaly_fleet_job.py``.
"""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from flwr.common.secure_aggregation.quantization import dequantize, quantize

from fedge.aggregator.anomaly.rounds import StatisticsFedAvg, fleet_fit
from fedge.aggregator.anomaly.secure import (
    fit_bounds,
    moment_range,
    quantization_range,
    secagg_privacy,
)
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.replies import arrays_of
from fedge.models.anomaly.private import clip_features
from fedge.models.anomaly.statistics import (
    COUNT_KEY,
    FIRST_MOMENT_KEY,
    GRID_KEY,
    SECOND_MOMENT_KEY,
    add_statistics,
    fit,
    station_statistics,
    statistics_to_moments,
)
from fedge.privacy.settings import PrivacyError, PrivacySpec

GRID = (2, 3)
DIMS = 4
MAX_WEIGHT = 5000.0


def test_the_ranges_come_from_the_clip_and_the_number_of_stations() -> None:
    assert moment_range(0.5) == 0.5  # first moments dominate below 1
    assert moment_range(3.0) == 9.0  # second moments above
    assert quantization_range(3) == 2**29  # 3 * 2**29 < 2**32
    assert quantization_range(4) == 2**29
    assert quantization_range(5) == 2**28
    assert quantization_range(1) == 2**30  # Flower rounds into int32
    assert quantization_range(600) == 2**21
    for parties in (3, 17, 600, 1024):
        assert parties * quantization_range(parties) < 2**32
    privacy = secagg_privacy(PrivacySpec(secagg=True), clip=2.0, parties=3)
    assert privacy.secagg_clipping_range == 4.0
    assert privacy.secagg_quantization_range == 2**29
    with pytest.raises(PrivacyError, match="clip > 0"):
        moment_range(0.0)
    with pytest.raises(PrivacyError, match="secagg is off"):
        secagg_privacy(PrivacySpec(), clip=2.0, parties=3)


def _secagg_mean(
    moments: list[dict[str, np.ndarray]], counts: list[int], privacy: PrivacySpec
) -> dict[str, np.ndarray]:
    """What SecAgg+ unmasks: Flower's quantisation of each weighted vector, summed."""
    c, T = privacy.secagg_clipping_range, privacy.secagg_quantization_range
    keys = [FIRST_MOMENT_KEY, SECOND_MOMENT_KEY]
    total = [np.zeros(m.shape, dtype=np.int64) for m in (moments[0][k] for k in keys)]
    q_total = 0
    for station, n in zip(moments, counts, strict=True):
        q_ratio = round(n / MAX_WEIGHT * T)  # secaggplus_mod: the quantised weight
        q_total += q_ratio
        scaled = [station[k] * (q_ratio / T) for k in keys]
        for index, q in enumerate(quantize(scaled, c, T)):
            total[index] = (total[index] + q) % 2**32  # the modulus the masks live in
    summed = dequantize(total, c, T)  # SecAggPlusWorkflow.unmask_stage
    offset = -(len(moments) - 1) * c
    return {k: (v + offset) * (T / q_total) for k, v in zip(keys, summed, strict=True)}


@pytest.mark.parametrize(("clip", "counts"), [(2.0, (40, 13, 7)), (0.8, (300, 2, 25, 9))])
def test_the_secagg_fit_is_within_the_stated_bound_of_the_plain_fit(
    clip: float, counts: tuple[int, ...]
) -> None:
    rng = np.random.default_rng(int(clip * 10))
    stations = [
        station_statistics(
            clip_features(rng.normal(1.0, 2.0, size=(n, GRID[0] * GRID[1], DIMS)), clip), GRID
        )
        for n in counts
    ]
    plain = fit(add_statistics(stations))
    privacy = secagg_privacy(PrivacySpec(secagg=True), clip=clip, parties=len(counts))
    mean = _secagg_mean([statistics_to_moments(s) for s in stations], list(counts), privacy)
    total = sum(counts)
    secure = fleet_fit(
        {
            **mean,
            GRID_KEY: np.array(GRID, dtype=np.float64),
            COUNT_KEY: np.array([total], dtype=np.float64),
        }
    )
    bounds = fit_bounds(counts, clip=clip, dims=DIMS, privacy=privacy, max_weight=MAX_WEIGHT)
    # The bound is a few millionths of the moments' range here, and it holds.
    assert 0 < bounds.moments < 1e-4 * moment_range(clip)
    pooled = add_statistics(stations)
    moments_error = max(
        np.max(np.abs(mean[FIRST_MOMENT_KEY] - pooled.total / total)),
        np.max(np.abs(mean[SECOND_MOMENT_KEY] - pooled.outer / total)),
    )
    assert 0 < moments_error <= bounds.moments
    assert np.max(np.abs(secure.mean - plain.mean)) <= bounds.mean
    frobenius = np.linalg.norm(secure.covariance - plain.covariance, axis=(1, 2))
    assert np.max(frobenius) <= bounds.covariance


def test_a_count_above_max_weight_has_no_bound() -> None:
    privacy = secagg_privacy(PrivacySpec(secagg=True), clip=2.0, parties=3)
    with pytest.raises(ValueError, match="exceed the clipping range"):
        fit_bounds([6000, 10, 10], clip=2.0, dims=DIMS, privacy=privacy, max_weight=MAX_WEIGHT)


def test_under_secagg_the_round_counts_the_clear_counts_and_restores_the_grid() -> None:
    privacy = secagg_privacy(PrivacySpec(secagg=True), clip=2.0, parties=3)
    strategy = StatisticsFedAvg(
        per_round=3, seed=0, backbone=ArrayRecord(), privacy=privacy, grid=GRID
    )
    strategy.counts = [40, 13, 7]
    locations = GRID[0] * GRID[1]
    mean = {
        FIRST_MOMENT_KEY: np.full((locations, DIMS), 0.5),
        SECOND_MOMENT_KEY: np.full((locations, DIMS, DIMS), 0.25),
    }
    fold = StreamingMean()
    fold.add(mean, 1.0)  # SecAgg+'s fold: the unmasked mean itself
    sent = ArrayRecord({k: Array(np.zeros_like(v)) for k, v in mean.items()})
    result = arrays_of(strategy.aggregate(1, sent, {"": fold}, {}))
    assert result[COUNT_KEY].tolist() == [60.0]
    assert result[GRID_KEY].tolist() == list(GRID)
    assert fleet_fit(result).count == 60

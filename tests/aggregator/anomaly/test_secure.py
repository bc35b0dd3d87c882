"""SecAgg+ for anomaly statistics: ranges from the clip, and the fit within the stated bound.

The quantisation is Flower's own (``flwr.common.secure_aggregation.quantization``), applied
as ``secaggplus_mod`` and ``SecAggPlusWorkflow`` apply it (scale by the quantised weight,
quantise, add, dequantise, shift, divide): what SecAgg+ unmasks without the masks, which
cancel exactly. The real protocol on real SuperNodes is
``tests/federation/test_anomaly_fleet_job.py``.
"""

from pathlib import Path
from typing import cast

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.serverapp import Grid

from fedge.aggregator.anomaly.rounds import BACKBONE_BYTES_KEY, StatisticsFedAvg, fleet_fit
from fedge.aggregator.anomaly.secure import (
    fit_bounds,
    moment_range,
    quantization_range,
    secagg_privacy,
)
from fedge.aggregator.anomaly.spec import AnomalySpec
from fedge.aggregator.jobs.runner import JobRounds
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
from fedge.party.anomaly_app import backbone_from_bytes
from fedge.party.errors import PartyError
from fedge.privacy.settings import PrivacyError, PrivacyMode, PrivacySpec

GRID = (2, 3)
DIMS = 4
MAX_WEIGHT = 5000.0
BACKBONE = {"conv.weight": np.arange(6.0).reshape(2, 3), "conv.bias": np.ones(2)}


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


def _job_rounds(tmp_path: Path, privacy: PrivacySpec) -> JobRounds:
    from fedge.aggregator.anomaly.rounds import anomaly_rounds, write_shape
    from fedge.aggregator.jobs.checkpoint import save_arrays
    from fedge.aggregator.jobs.run_store import RunStore

    write_shape(tmp_path, GRID, DIMS)
    save_arrays(tmp_path / "initial.npz", BACKBONE)
    store = RunStore(tmp_path / "runs.db")
    store.close()
    return anomaly_rounds(
        cast(Grid, None),  # opened only when the round is played
        tmp_path,
        spec_text="{}",
        anomaly=AnomalySpec(clip=2.0, privacy=privacy),
        backbone_path=tmp_path / "initial.npz",
        parties={"st-01": 1000, "st-02": 1001, "st-03": 1002},
        store=store,
        run_id="run-1",
        wait_for_parties=lambda _: None,
        eval_timeout_s=1.0,
        round_timeout_s=1.0,
        max_weight=MAX_WEIGHT,
    )


def test_a_secagg_job_sends_the_moments_alone_and_the_backbone_in_its_config(
    tmp_path: Path,
) -> None:
    job = _job_rounds(tmp_path, PrivacySpec(secagg=True))
    assert sorted(job.initial_arrays().keys()) == [FIRST_MOMENT_KEY, SECOND_MOMENT_KEY]
    assert job.strategy.privacy.secagg_clipping_range == 4.0  # clip 2: second moments
    assert job.strategy.privacy.secagg_quantization_range == 2**29  # three stations
    backbone = backbone_from_bytes(job.train_config[BACKBONE_BYTES_KEY])
    assert {k: v.numpy().tolist() for k, v in backbone.items()} == {
        k: v.tolist() for k, v in BACKBONE.items()
    }
    with pytest.raises(PartyError, match="npz"):
        backbone_from_bytes(b"not an archive")


def test_a_dp_job_tells_the_stations_its_privacy_and_sends_the_grid(tmp_path: Path) -> None:
    local = PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=1.5)
    job = _job_rounds(tmp_path, local)
    assert GRID_KEY in job.initial_arrays()
    assert BACKBONE_BYTES_KEY not in job.train_config
    assert job.train_config["dp-mode"] == "local"
    assert job.train_config["dp-noise-multiplier"] == 1.5

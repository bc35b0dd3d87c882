"""A station's anomaly statistics under its floor and ledger: the same rules as DP-SGD rounds.

The ledger is the station's real SQLite ledger (:class:`fedge.party.budget.BudgetLedger`);
the stations' rounds run on real kept images (SQLite store, PNG files).
"""

import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord

from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.models.anomaly.private import clip_features
from fedge.models.anomaly.statistics import (
    FIRST_MOMENT_KEY,
    GRID_KEY,
    SECOND_MOMENT_KEY,
    SufficientStatistics,
    fit,
    station_statistics,
)
from fedge.party.anomaly_private import check_round, plan_release, release_statistics
from fedge.party.anomaly_round import moments_round, threshold_round
from fedge.party.budget import BudgetLedger
from fedge.party.privacy_status import ledger_path
from fedge.party.station_store import Retention, StationData
from fedge.privacy import accounting
from fedge.privacy.floor import PrivacyFloor, PrivacyFloorError
from fedge.privacy.settings import (
    BudgetExhaustedError,
    DpRelease,
    PrivacyError,
    PrivacyMode,
    PrivacySpec,
)

from .test_anomaly_round import SPEC, _arrays, _png, _station

LOCAL = PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=2.0, delta=1e-5)


def _stats(n: int = 30, clip: float = 1.5) -> SufficientStatistics:
    rng = np.random.default_rng(0)
    return station_statistics(clip_features(rng.normal(size=(n, 4, 3)), clip), (2, 2))


def test_a_release_is_one_gaussian_mechanism_recorded_in_the_ledger(tmp_path: Path) -> None:
    path = tmp_path / "privacy.db"
    stats = _stats()
    released = release_statistics(
        stats,
        privacy=LOCAL,
        floor=None,
        clip=1.5,
        ledger_path=path,
        job="job-1",
        server_round=1,
        rng=np.random.default_rng(1),
    )
    ledger = BudgetLedger(path)
    try:
        assert ledger.history("job-1") == [DpRelease(2.0, 1.0, 1)]
    finally:
        ledger.close()
    expected = accounting.epsilon_spent([DpRelease(2.0, 1.0, 1)], 1e-5)
    assert released.epsilon_job == pytest.approx(expected)
    assert not np.allclose(released.stats.total, stats.total)  # the noise is added
    metrics = released.metrics(1e-5)
    assert metrics["num-examples"] == released.stats.count  # the noisy count leaves, no other
    assert set(metrics) == {
        "num-examples",
        "dp-epsilon-job",
        "dp-epsilon-total",
        "dp-noise-multiplier",
        "dp-delta",
    }


def test_a_target_epsilon_plans_the_noise_of_one_release() -> None:
    release = plan_release(PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=4.0, delta=1e-5))
    assert (release.sample_rate, release.steps) == (1.0, 1)
    spent = accounting.epsilon_spent([release], 1e-5)
    assert 3.8 < spent <= 4.0


def test_the_floor_refuses_what_a_classifier_round_would_be_refused(tmp_path: Path) -> None:
    floor = PrivacyFloor(job_epsilon=4.0, lifetime_epsilon=8.0, delta=1e-5)
    with pytest.raises(PrivacyFloorError, match="dp-mode 'none'"):
        check_round("st-1", PrivacySpec(secagg=True), floor, None)
    with pytest.raises(PrivacyFloorError, match=r"noise multiplier 0\.3"):
        check_round("st-1", PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=0.3), floor, None)
    with pytest.raises(PrivacyFloorError, match="epsilon 8"):
        check_round("st-1", PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=8.0), floor, None)
    with pytest.raises(BudgetExhaustedError, match="lifetime privacy budget"):
        check_round("st-1", PrivacySpec(), None, 3.0)
    with pytest.raises(PrivacyError, match="raw statistics"):
        check_round("st-1", PrivacySpec(mode=PrivacyMode.CENTRAL, noise_multiplier=1.0), None, None)
    # The job's noise, bounded by the floor's job epsilon at its smaller delta.
    honoured = check_round("st-1", LOCAL, floor, None)
    assert (honoured.epsilon, honoured.delta) == (4.0, 1e-5)
    assert check_round("st-1", PrivacySpec(secagg=True), None, None).secagg


def test_a_release_past_the_budget_is_refused_and_nothing_is_recorded(tmp_path: Path) -> None:
    path = tmp_path / "privacy.db"
    tight = PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=0.6, epsilon=1.0, delta=1e-5)
    with pytest.raises(BudgetExhaustedError):
        release_statistics(
            _stats(),
            privacy=tight,
            floor=None,
            clip=1.5,
            ledger_path=path,
            job="job-2",
            server_round=1,
        )
    floor = PrivacyFloor(min_noise_multiplier=3.0, delta=1e-5)
    with pytest.raises(PrivacyFloorError, match="noise multiplier"):
        release_statistics(
            _stats(),
            privacy=LOCAL,
            floor=floor,
            clip=1.5,
            ledger_path=path,
            job="job-3",
            server_round=1,
        )
    ledger = BudgetLedger(path)
    try:
        assert ledger.history(None) == []
    finally:
        ledger.close()


def _dp_config() -> ConfigRecord:
    config: dict[str, str | float | int | bool] = {
        **LOCAL.to_config(),
        "anomaly-clip": 2.0,
        "job-id": "run-7",
        "server-round": 1,
    }
    return ConfigRecord(dict(config))


def test_a_dp_round_at_a_station_sends_the_noisy_release_and_records_it(
    tmp_path: Path,
) -> None:
    station = _station(tmp_path, "st-1", 24, 5)
    sent = [FIRST_MOMENT_KEY, SECOND_MOMENT_KEY]  # what a SecAgg+ round sends: no grid
    record, metrics = moments_round(station, SPEC, _arrays(), _dp_config(), sent=sent)
    assert sorted(record.keys()) == sorted(sent)
    assert GRID_KEY not in record
    assert metrics["dp-noise-multiplier"] == 2.0
    assert "skipped-unreadable" not in metrics  # no number outside the ledger
    ledger = BudgetLedger(ledger_path(station.data_dir))
    try:
        assert ledger.history("run-7") == [DpRelease(2.0, 1.0, 1)]
    finally:
        ledger.close()
    # No threshold under DP: a quantile of held-out scores is no DP release.
    model = fit(_stats(10))
    with pytest.raises(PrivacyError, match="no DP release"):
        threshold_round(station, SPEC, _arrays(), model, _dp_config())


def test_a_station_with_a_floor_refuses_a_round_without_dp_before_computing_anything(
    tmp_path: Path,
) -> None:
    station = _station(tmp_path, "st-2", 8, 6)
    ledger = BudgetLedger(ledger_path(station.data_dir))
    try:
        ledger.set_floor(PrivacyFloor(delta=1e-5))
    finally:
        ledger.close()
    with pytest.raises(PrivacyFloorError, match="refuses"):
        moments_round(station, SPEC, ArrayRecord(), ConfigRecord({"anomaly-clip": 2.0}))


def test_a_station_with_no_good_parts_refuses_before_spending_budget(tmp_path: Path) -> None:
    data = StationData(tmp_path, Retention(holdout_percent=25))
    images, _ = make_defect_images(4, seed=2, scratch_fraction=1.0)
    for index, image in enumerate(images):
        data.keep(f"p-{index}", _png(image), ".png", at=time.time() + index)
        data.label(f"p-{index}", CLASSES[1], at=float(index))
    data.close()
    from fedge.party.errors import PartyError
    from fedge.party.station_app import Station

    station = Station("st-3", tmp_path, 25, 1, 60.0)
    with pytest.raises(PartyError, match="no good parts"):
        moments_round(station, SPEC, _arrays(), _dp_config())
    path = ledger_path(tmp_path)
    if path.exists():
        ledger = BudgetLedger(path)
        try:
            assert ledger.history(None) == []
        finally:
            ledger.close()

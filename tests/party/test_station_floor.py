"""The station's ClientApp under its own privacy floor (issue 24, items 2 and 3).

The real ClientApp functions (``train_round``, ``evaluate_round``) on a real station data
directory (kept images, labels) and its real SQLite ledger, the floor written the way the
agent writes it at start (:func:`fedge.edge_agent.config.privacy_budget.write_floor`).
"""

import io
import time
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, ConfigRecord
from PIL import Image

from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.edge_agent.config.privacy_budget import apply_budget, write_floor
from fedge.models.inspection import new_model
from fedge.party.budget import BudgetLedger
from fedge.party.privacy_status import LEDGER_FILE
from fedge.party.station_app import Station, evaluate_round, station_floor, train_round
from fedge.party.station_store import Retention, StationData
from fedge.privacy import accounting
from fedge.privacy.floor import PrivacyFloor, PrivacyFloorError
from fedge.privacy.settings import BudgetExhaustedError, DpRelease, PrivacyMode, PrivacySpec
from fedge.protocols.config import PrivacyBudget
from fedge.protocols.manifest import Preprocess
from fedge.protocols.model_spec import ModelSpec

SPEC = ModelSpec("inspection-cnn", {"width": 4}, CLASSES, Preprocess(image_size=32))
FLOOR = PrivacyFloor(
    job_epsilon=8.0, lifetime_epsilon=16.0, delta=2e-5, min_noise_multiplier=0.5,
    evaluations_per_job=2, evaluation_noise=5.0,
)  # fmt: skip
JOB = "fleet-floor-1a2b"
NOT_DP = "train-loss", "local-acc", "holdout-acc-after", "skipped-unreadable"


def station_with(root: Path, floor: PrivacyFloor | None, n: int = 24) -> Station:
    data = StationData(root, Retention(holdout_percent=25))
    images, labels = make_defect_images(n, seed=7)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        pid = f"p-{index:04d}"
        data.keep(pid, buffer.getvalue(), ".png", at=time.time() + index)
        data.label(pid, CLASSES[int(label)], at=float(index))
    data.close()
    write_floor(root, floor)  # as the agent does at start, from agent.toml
    return Station("st-01", root, 25, 1, 60.0)


def arrays() -> ArrayRecord:
    return ArrayRecord(new_model(0, width=4).state_dict())


def config(spec: PrivacySpec, **extra: object) -> ConfigRecord:
    values = {"lr": 0.01, "local-epochs": 1, "batch-size": 8, "server-round": 1}
    return ConfigRecord({**values, **spec.to_config(), **extra})  # type: ignore[dict-item]


def releases(station: Station) -> tuple[list[DpRelease], list[DpRelease]]:
    """(training releases, evaluation releases) in the station's ledger."""
    ledger = BudgetLedger(station.data_dir / LEDGER_FILE)
    try:
        return ledger.history(), ledger.evaluations()
    finally:
        ledger.close()


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (PrivacySpec(), "dp-mode 'none'"),
        (PrivacySpec(mode=PrivacyMode.CENTRAL, noise_multiplier=1.0), "dp-mode 'central'"),
        (PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=0.2), "noise multiplier 0.2"),
        (PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=50.0), "asks for epsilon 50"),
    ],
)
def test_a_round_below_the_floor_is_refused_before_training_and_changes_nothing(
    tmp_path: Path, spec: PrivacySpec, named: str
) -> None:
    station = station_with(tmp_path, FLOOR)
    with pytest.raises(PrivacyFloorError) as refused:
        train_round(station, SPEC, arrays(), config(spec), job=JOB)
    message = str(refused.value)
    assert message.startswith("station st-01 refuses: ") and named in message
    assert "the station's privacy floor (DP-SGD, epsilon <= 8 per job" in message
    assert releases(station) == ([], [])


@pytest.mark.slow
def test_a_planned_noise_below_the_floor_is_refused(tmp_path: Path) -> None:
    """A target epsilon the job's plan meets with too little noise: refused, unreserved."""
    station = station_with(tmp_path, PrivacyFloor(min_noise_multiplier=5.0))
    generous = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=8.0, delta=1e-3, rounds_per_party=1)
    with pytest.raises(PrivacyFloorError, match=r"needs noise multiplier .* below the station"):
        train_round(station, SPEC, arrays(), config(generous), job=JOB)
    assert releases(station) == ([], [])


def test_a_round_past_the_floors_lifetime_is_refused_though_the_manager_cleared_its_budget(
    tmp_path: Path,
) -> None:
    earlier = DpRelease(1.0, 0.25, 40)
    # Room in this job's own bound (a round costs ~2), none left in the lifetime.
    spent = accounting.epsilon_spent([earlier], 2e-5)
    floor = PrivacyFloor(job_epsilon=spent * 1.01, lifetime_epsilon=spent * 1.01)
    station = station_with(tmp_path, floor)
    apply_budget(tmp_path, PrivacyBudget(100.0, 1e-3))  # the manager's: looser, ignored
    apply_budget(tmp_path, None)  # `fedge edge set-privacy --clear`: the floor stays
    ledger = BudgetLedger(tmp_path / LEDGER_FILE)
    try:
        ledger.record("an-earlier-job", 1, earlier)
    finally:
        ledger.close()
    dp = PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=2.0)
    with pytest.raises(BudgetExhaustedError, match="the station's privacy floor"):
        train_round(station, SPEC, arrays(), config(dp), job=JOB)
    assert releases(station) == ([earlier], [])


@pytest.mark.slow
def test_a_dp_round_within_the_floor_trains_and_sends_only_accounted_numbers(
    tmp_path: Path,
) -> None:
    station = station_with(tmp_path, FLOOR)
    dp = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=4.0, delta=1e-3, rounds_per_party=3)
    _, metrics = train_round(station, SPEC, arrays(), config(dp), job=JOB)
    (release,) = releases(station)[0]
    assert metrics["dp-steps"] == release.steps > 0
    assert metrics["dp-delta"] == FLOOR.delta  # accounted at the station's smaller delta
    assert release.noise_multiplier >= FLOOR.min_noise_multiplier
    assert not set(NOT_DP) & set(metrics), metrics  # nothing unaccounted about the data
    assert {"num-examples", "holdout-examples", "dp-epsilon-job"} <= set(metrics)


def test_without_a_floor_a_round_without_dp_still_trains_and_reports_everything(
    tmp_path: Path,
) -> None:
    station = station_with(tmp_path, None)  # the station's operator opted out
    _, metrics = train_round(station, SPEC, arrays(), config(PrivacySpec()), job=JOB)
    assert set(NOT_DP) <= set(metrics)
    assert releases(station) == ([], [])


def test_evaluations_under_the_floor_are_noised_counted_and_limited_per_job(
    tmp_path: Path,
) -> None:
    station = station_with(tmp_path, FLOOR)
    first = evaluate_round(station, SPEC, arrays(), ConfigRecord(), job=JOB)
    second = evaluate_round(station, SPEC, arrays(), ConfigRecord(), job=JOB)
    assert 0.0 <= first["eval-acc"] <= 1.0 and first["num-examples"] > 0
    assert 0.0 <= second["eval-acc"] <= 1.0
    with pytest.raises(PrivacyFloorError, match="evaluations_per_job = 2"):
        evaluate_round(station, SPEC, arrays(), ConfigRecord(), job=JOB)
    assert releases(station) == ([], [DpRelease(5.0, 1.0, 1)] * 2)
    # Another job has its own allowance (the lifetime bound still counts them all).
    evaluate_round(station, SPEC, arrays(), ConfigRecord(), job="another-job")
    assert len(releases(station)[1]) == 3


def test_a_dp_job_on_a_station_without_a_floor_evaluates_privately_too(
    tmp_path: Path,
) -> None:
    station = station_with(tmp_path, None)
    dp = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=4.0)
    evaluate_round(station, SPEC, arrays(), config(dp), job=JOB)
    assert len(releases(station)[1]) == 1
    # A job without DP on such a station: exact, and nothing recorded.
    plain = evaluate_round(station, SPEC, arrays(), ConfigRecord(), job=JOB)
    assert 0.0 <= plain["eval-acc"] <= 1.0
    assert len(releases(station)[1]) == 1


def test_a_required_floor_missing_from_the_ledger_fails_closed(tmp_path: Path) -> None:
    """The agent says the station has a floor; a ledger without it (deleted, or an agent
    that never started) refuses to train rather than training without DP (review, issue 24)."""
    config = {"edge": "st-01", "data-dir": str(tmp_path), "privacy-floor": "required"}
    station = Station.from_node_config(config)
    assert station.floor_required
    with pytest.raises(PrivacyFloorError, match="none in its ledger"):
        station_floor(station)
    opted_out = Station.from_node_config({**config, "privacy-floor": "none"})
    assert station_floor(opted_out) is None

"""A station's DP-SGD rounds: accounted in its ledger, refused past its budget, for good.

The station's ClientApp code (``train_round``) on real kept images and a real SQLite
ledger in the data directory; the refusal after a restart is checked in a new process.
"""

import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from PIL import Image

from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.models.inspection import new_model
from fedge.party.budget import BudgetLedger
from fedge.party.errors import PartyError
from fedge.party.privacy_status import LEDGER_FILE, read_spent
from fedge.party.station_app import Station, round_job, train_round
from fedge.party.station_store import Retention, StationData
from fedge.privacy import accounting
from fedge.privacy.settings import BudgetExhaustedError, PrivacyError, PrivacyMode, PrivacySpec
from fedge.protocols.manifest import Preprocess
from fedge.protocols.model_spec import ModelSpec

SPEC = ModelSpec("inspection-cnn", {"width": 4}, CLASSES, Preprocess(image_size=32))
DP = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=8.0, delta=1e-3, rounds_per_party=3)
JOB = "fleet-test-1a2b3c4d"


def station_with(root: Path, n: int = 24) -> Station:
    data = StationData(root, Retention(holdout_percent=25))
    images, labels = make_defect_images(n, seed=7)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        pid = f"p-{index:04d}"
        data.keep(pid, buffer.getvalue(), ".png", at=time.time() + index)
        data.label(pid, CLASSES[int(label)], at=float(index))
    data.close()
    return Station("st-01", root, 25, 1, 60.0)


def arrays() -> ArrayRecord:
    return ArrayRecord(new_model(0, width=4).state_dict())


def dp_config(server_round: int, spec: PrivacySpec = DP, **extra: object) -> ConfigRecord:
    values = {"lr": 0.01, "local-epochs": 1, "batch-size": 8, "server-round": server_round}
    return ConfigRecord({**values, **spec.to_config(), **extra})  # type: ignore[dict-item]


def ledger_of(station: Station) -> BudgetLedger:
    return BudgetLedger(station.data_dir / LEDGER_FILE)


@pytest.mark.slow
def test_a_dp_round_reports_the_epsilon_of_what_its_ledger_recorded(tmp_path: Path) -> None:
    station = station_with(tmp_path)
    new, metrics = train_round(station, SPEC, arrays(), dp_config(1), job=JOB)
    ledger = ledger_of(station)
    try:
        history = ledger.history(JOB)
    finally:
        ledger.close()
    (release,) = history
    # An independent computation from Opacus' accountant over what the ledger holds.
    assert metrics["dp-epsilon-round"] == pytest.approx(
        accounting.epsilon_spent([release], DP.delta), rel=1e-9
    )
    assert metrics["dp-epsilon-job"] == pytest.approx(
        accounting.epsilon_spent(history, DP.delta), rel=1e-9
    )
    assert metrics["dp-epsilon-total"] == metrics["dp-epsilon-job"]
    assert 0 < metrics["dp-epsilon-round"] < 8.0  # the job's whole target is for 3 rounds
    assert metrics["dp-noise-multiplier"] == release.noise_multiplier > 0
    assert metrics["dp-sample-rate"] == release.sample_rate
    # One epoch: one step per batch of 8 the training images make (Poisson-sampled).
    assert metrics["dp-steps"] == release.steps == math.ceil(metrics["num-examples"] / 8)
    assert metrics["stopped-early"] == 0
    before = arrays()
    assert any(not np.array_equal(new[k].numpy(), before[k].numpy()) for k in new)
    # The report the agent sends up: the lifetime total at the ledger's delta.
    spent = read_spent(station.data_dir)
    assert spent is not None and spent.delta == 1e-3
    assert spent.epsilon == pytest.approx(metrics["dp-epsilon-total"], rel=1e-9)


def test_a_round_trained_again_is_a_second_release(tmp_path: Path) -> None:
    """A round retried after a crash trains again: its first update may have reached the
    server, so the ledger counts both trainings (never under-counts)."""
    station = station_with(tmp_path)
    _, first = train_round(station, SPEC, arrays(), dp_config(1), job=JOB)
    _, again = train_round(station, SPEC, arrays(), dp_config(1), job=JOB)
    ledger = ledger_of(station)
    try:
        assert len(ledger.history(JOB)) == 2
    finally:
        ledger.close()
    assert again["dp-epsilon-job"] > first["dp-epsilon-job"]
    assert first["dp-epsilon-job"] == pytest.approx(first["dp-epsilon-round"], rel=1e-9)


REFUSE_IN_A_NEW_PROCESS = """
import sys
from pathlib import Path
from flwr.app import ArrayRecord, ConfigRecord
from fedge.models.inspection import new_model
from fedge.privacy.settings import BudgetExhaustedError
from fedge.party.station_app import Station, train_round
from fedge.protocols.model_spec import ModelSpec
spec = ModelSpec.from_json(sys.argv[2])
config = ConfigRecord({**__import__("json").loads(sys.argv[3])})
station = Station("st-01", Path(sys.argv[1]), 25, 1, 60.0)
try:
    train_round(station, spec, ArrayRecord(new_model(0, width=4).state_dict()), config,
                job=sys.argv[4])
except BudgetExhaustedError as exc:
    print("refused:", exc)
else:
    print("trained")
"""


@pytest.mark.slow
def test_a_station_at_its_lifetime_budget_refuses_and_keeps_refusing_after_a_restart(
    tmp_path: Path,
) -> None:
    station = station_with(tmp_path)
    _, metrics = train_round(station, SPEC, arrays(), dp_config(1), job=JOB)
    ledger = ledger_of(station)
    try:
        # The operator's lifetime bound (as the agent writes it): just what is spent.
        ledger.set_lifetime(metrics["dp-epsilon-total"] * 1.01, 1e-3)
    finally:
        ledger.close()
    other_job = "another-job-5e6f7a8b"  # the lifetime bound holds across jobs
    with pytest.raises(BudgetExhaustedError, match="lifetime privacy budget exhausted"):
        train_round(station, SPEC, arrays(), dp_config(1), job=other_job)
    ledger = ledger_of(station)
    try:
        assert len(ledger.history()) == 1  # refused before training: nothing recorded
    finally:
        ledger.close()

    # A restarted station: a new process, a new ledger object on the same file.
    config = {k: v for k, v in dp_config(2).items()}
    result = subprocess.run(
        [sys.executable, "-c", REFUSE_IN_A_NEW_PROCESS, str(tmp_path), SPEC.to_json(),
         json.dumps(config), other_job],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("refused: lifetime privacy budget exhausted"), result.stdout
    assert "fedge edge set-privacy" in result.stdout
    ledger = ledger_of(station)
    try:
        assert len(ledger.history()) == 1
    finally:
        ledger.close()


@pytest.mark.slow
def test_the_jobs_own_target_ends_its_rounds_on_this_station(tmp_path: Path) -> None:
    station = station_with(tmp_path)
    spec = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=4.0, delta=1e-3, rounds_per_party=1)
    train_round(station, SPEC, arrays(), dp_config(1, spec), job=JOB)
    with pytest.raises(BudgetExhaustedError, match=f"privacy budget of job '{JOB}' exhausted"):
        train_round(station, SPEC, arrays(), dp_config(2, spec), job=JOB)


def test_bad_privacy_settings_and_job_ids_are_refused_before_training(tmp_path: Path) -> None:
    station = station_with(tmp_path, 12)
    with pytest.raises(PrivacyError, match=r"needs a target privacy\.epsilon"):
        train_round(station, SPEC, arrays(), ConfigRecord({"dp-mode": "local"}), job=JOB)
    with pytest.raises(PrivacyError, match="dp-mode"):
        train_round(station, SPEC, arrays(), ConfigRecord({"dp-mode": "loud"}), job=JOB)
    with pytest.raises(PrivacyError, match="delta"):
        train_round(station, SPEC, arrays(), dp_config(1, DP, **{"dp-delta": 1.0}), job=JOB)
    with pytest.raises(PrivacyError, match="job's id"):
        train_round(station, SPEC, arrays(), dp_config(1), job="")
    assert not (tmp_path / LEDGER_FILE).exists()  # refused before any ledger was opened
    assert round_job(ConfigRecord({"job-id": JOB}), 7) == JOB
    assert round_job(ConfigRecord(), 7) == "flwr-run-7"
    with pytest.raises(PartyError, match="job-id"):
        round_job(ConfigRecord({"job-id": " "}), 7)


def test_a_round_without_dp_trains_as_before_and_touches_no_ledger(tmp_path: Path) -> None:
    station = station_with(tmp_path, 12)
    _, metrics = train_round(station, SPEC, arrays(), ConfigRecord({"local-epochs": 1}))
    assert not any(key.startswith("dp-") for key in metrics)
    assert not (tmp_path / LEDGER_FILE).exists()


def test_a_station_with_a_lifetime_bound_trains_only_with_dp_sgd(tmp_path: Path) -> None:
    """A job without DP-SGD (or with central DP, where the server sees the raw update)
    would release an update the station's ledger cannot account: refused before training."""
    station = station_with(tmp_path, 12)
    ledger = ledger_of(station)
    try:
        ledger.set_lifetime(8.0, 1e-3)
    finally:
        ledger.close()
    central = PrivacySpec(mode=PrivacyMode.CENTRAL, noise_multiplier=1.0)
    for config in (ConfigRecord({"local-epochs": 1}), dp_config(1, central)):
        with pytest.raises(BudgetExhaustedError, match="trains only with DP-SGD"):
            train_round(station, SPEC, arrays(), config, job=JOB)
    ledger = ledger_of(station)
    try:
        assert ledger.history() == []  # nothing trained, nothing spent
    finally:
        ledger.close()
    _, metrics = train_round(station, SPEC, arrays(), dp_config(1), job=JOB)
    assert metrics["dp-epsilon-round"] > 0  # DP-SGD still trains

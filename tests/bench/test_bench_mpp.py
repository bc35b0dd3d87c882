"""``fedge bench mpp`` at a tiny size, through the CLI: the JSON contract in seconds.

The primary CNN trains on 300 images for one epoch (a real, if weak, model); every
scenario, estimator and drift stream of the full run is there, at a size where only the
strong lighting shift is asserted to be caught.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedge.bench.mpp_images import SCENARIOS, STREAM_SHIFTS
from fedge.cli.main import app

TINY = [
    "--train-images", "300", "--epochs", "1", "--gate-images", "150", "--test-images", "100",
    "--stream-before", "200", "--stream-after", "100", "--window", "50", "--step", "25",
]  # fmt: skip
ESTIMATORS = {"mpp", "mpp_plain", "calibration", "atc"}


def run_bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["bench", "mpp", *TINY, *args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(out.read_text())
    assert '"benchmark": "mpp"' in result.stdout
    return data


@pytest.mark.integration
def test_one_seed_reports_every_scenario_and_stream(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "--seed", "3")
    assert data["seed"] == 3
    assert set(data["scenarios"]) == set(SCENARIOS)
    for name, scenario in data["scenarios"].items():
        assert scenario["images"] == 100, name
        truth = scenario["true_accuracy"]
        assert 0.0 <= truth <= 1.0
        assert set(scenario["estimate"]) == ESTIMATORS
        for key, estimate in scenario["estimate"].items():
            assert 0.0 <= estimate <= 1.0
            assert scenario["abs_error"][key] == round(abs(estimate - truth), 4)
    # Dents are a defect the model never saw: it misses some, so accuracy drops.
    assert data["scenarios"]["new_defect_dents"]["true_accuracy"] < 0.9

    assert set(data["drift_streams"]) == set(STREAM_SHIFTS)
    for stream in data["drift_streams"].values():
        assert stream["shift_at"] == 200 and stream["images"] == 300
        assert stream["windows"] == 11  # window ends 50, 75, ..., 300
    lighting = data["drift_streams"]["lighting_gradient"]
    assert lighting["images_after_shift_to_alert"] is not None
    assert 0 < lighting["images_after_shift_to_alert"] <= 100
    assert lighting["features"]
    assert data["drift_in_distribution_stream"]["images"] == 300

    # The product's MPP is fitted on the gate images and their re-lit copies, as stations
    # report them; the plain fit (gate images only) is reported beside it.
    assert data["mpp"]["relit_copies"] == 2
    assert "2 re-lit copies of each" in data["mpp"]["fitted_on"]
    assert 0.0 <= data["mpp"]["relit_accuracy"] <= 1.0
    assert data["mpp_plain"]["fitted_on"].endswith("only")
    assert data["met_target"] == all(data["checks"].values())
    assert {"mpp_in_distribution", "mpp_lighting_spot", "no_false_alert"} <= set(data["checks"])
    assert data["machine"]["cpu_count"] >= 1
    assert data["wall_s"]["train"] > 0


@pytest.mark.slow
def test_seeds_report_medians_and_every_run(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "--seeds", "2")
    assert data["seeds"] == [0, 1]
    assert [run["seed"] for run in data["per_seed"]] == [0, 1]
    in_distribution = data["scenarios"]["in_distribution"]
    runs = [run["scenarios"]["in_distribution"]["true_accuracy"] for run in data["per_seed"]]
    assert in_distribution["true_accuracy"] == round(sum(runs) / 2, 4)
    assert set(data["checks_per_seed"]) == {"0", "1"}
    assert len(data["drift_streams"]["lighting_gradient"]["per_seed"]) == 2


def test_seed_and_seeds_together_is_an_error(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(
        app, ["bench", "mpp", "--seed", "1", "--seeds", "2", "--json", str(out)]
    )
    assert result.exit_code != 0
    assert "--seed or --seeds" in result.output
    assert not out.exists()

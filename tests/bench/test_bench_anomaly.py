"""``fedge bench anomaly`` at a tiny size, through the CLI: the JSON contract.

The backbone CNN trains on 200 images for one epoch (a real, if weak, model); stations,
the federated and pooled fits, the smallest station and the ONNX serving cost are all
there. Exactness is asserted at this size; AUROC targets only at the full size.
"""

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from fedge.bench.anomaly import AnomalyBenchSize, auroc
from fedge.bench.errors import BenchError
from fedge.cli.main import app

TINY = [
    "--train-images", "200", "--epochs", "1", "--station-parts", "60,30,5",
    "--test-images", "200",  # a 1 % threshold rests on >= 99 held-out good parts
]  # fmt: skip
KEYS = {
    "auroc_unseen", "pooled_max_abs_diff", "auroc_gain_smallest_station",
    "serving_cost_ratio", "seeds", "met_target", "machine",
    "novel_alert_images", "mpp_drift_alert_images", "false_alerts",
}  # fmt: skip


@pytest.mark.integration  # trains a CNN and times ONNX Runtime for several seconds
def test_two_seeds_report_the_contract_and_federated_equals_pooled(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(
        app, ["bench", "anomaly", *TINY, "--seeds", "2", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(out.read_text())
    assert set(data) >= KEYS
    assert data["seeds"] == [0, 1]
    assert data["pooled_max_abs_diff"] <= 1e-5
    assert data["checks"]["auroc_equal_every_seed"]
    for run in data["per_seed"]:
        assert run["auroc"]["federated"] == run["auroc"]["pooled"]
        assert run["pooled_diff"]["scores_served_float32"] <= 1e-5
        assert 0.0 <= run["auroc_unseen"] <= 1.0
        assert run["smallest_station"]["good_parts"] == 5
    cost = data["serving_cost"]
    # A ratio of two timings of a few hundred images on a shared host: its size is the
    # benchmark's to report (BENCHMARKS.md section 22), not this test's to bound.
    assert cost["ratio"] == data["serving_cost_ratio"] > 0.0
    assert set(cost["ms_per_image"]) == {"classifier", "shared", "separate"}
    # Issue 28: the pair through the agent's own scoring path, and the novel-defect streams.
    assert set(cost["agent_serving_path"]["ms_per_image"]) == {"classifier", "with_anomaly"}
    novel = cost["novel_detection"]
    assert len(novel["novel_parts_clean_streams"]) == 5  # quality: the full size only
    assert len(novel["dent_streams"]) == len(novel["novel_alert_images_per_stream"]) == 5
    # A false alert: on a clean stream, or on a dent stream before its first dent.
    assert data["false_alerts"] == novel["false_alerts"] <= novel["clean_streams"] + 5
    assert data["novel_alert_images"] == novel["novel_alert_images"]
    assert 0.0 <= novel["novel_alert_within_30_share"] <= 1.0
    # Issue 28: the gain of federation at the smallest station, by its size.
    assert set(data["auroc_gain_by_station_size_median"]) == {"5", "10", "20", "40", "80"}
    assert data["machine"]["cpu_count"] >= 1
    # Issue 28 item 4: each station's threshold by three rules, on fresh good parts.
    calibration = data["threshold_false_alarms"]
    for rate in ("0.05", "0.01"):
        assert set(calibration[rate]) == {"60", "30", "5"}
        small = calibration[rate]["5"]
        assert small["left_out"] == 5 and small["held_out"] == 1
        rules = small["false_alarm_rate"]
        assert set(rules) == {
            "empirical_held_out", "conformal_held_out", "conformal_with_left_out",
        }  # fmt: skip
        # One held-out part is too few for a conformal threshold at either rate: both
        # seeds set none; the old rule always set one (the single part's score).
        assert rules["conformal_held_out"] == {"mean": None, "no_threshold_seeds": 2}
        assert rules["empirical_held_out"]["no_threshold_seeds"] == 0
    # 60 parts + 15 held out: enough for 5 % with the left-out parts, not for 1 %.
    assert (
        calibration["0.05"]["60"]["false_alarm_rate"]["conformal_with_left_out"][
            "no_threshold_seeds"
        ]
        == 0
    )


def test_auroc_counts_ties_half_and_orders() -> None:
    assert auroc(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 1.0
    assert auroc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 0.0
    assert auroc(np.array([1.0]), np.array([1.0])) == 0.5


def test_a_bench_without_two_stations_is_refused() -> None:
    with pytest.raises(BenchError, match="at least 2 stations"):
        AnomalyBenchSize(station_parts=(10,))


def test_a_bench_with_too_few_held_out_parts_for_its_threshold_is_refused() -> None:
    with pytest.raises(BenchError, match=r"needs >= 99 held-out good parts"):
        AnomalyBenchSize(test_good=40, station_test_good=20)

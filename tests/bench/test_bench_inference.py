"""``fedge bench inference --path library|api|inbox --kept N``, at a tiny size, via the CLI.

Real ONNX Runtime, SQLite, the agent's local API and inbox watcher; the model is the
inspection CNN trained for one epoch on 256 images of 32 x 32 (in a child process, as at
full size). The JSON contract of issue 25 is checked, and that every side really ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedge.bench.inference_paths import TARGET_GROWTH, TARGET_P99_RATIO, TARGET_RATIO
from fedge.cli.main import app

pytestmark = pytest.mark.integration

SMALL = [
    "--images", "24", "--rounds", "3", "--per-round", "16", "--batch-size", "8",
    "--image-size", "32", "--epochs", "1", "--train-images", "256",
]  # fmt: skip


def run_inference(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["bench", "inference", *args, *SMALL, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(out.read_text())
    assert '"benchmark": "inference"' in result.stdout
    return data


@pytest.mark.parametrize("path", ["library", "api", "inbox", "inbox-scan"])
def test_each_path_is_timed_against_its_baseline_and_a_fresh_station(
    tmp_path: Path, path: str
) -> None:
    data = run_inference(tmp_path, "--path", path, "--kept", "40")
    assert (data["path"], data["kept"]) == (path, 40)
    single = data["single"]
    for side in ("agent", "agent_kept_0", "baseline"):
        assert single[side]["images"] == 3 * 16
        assert 0 < single[side]["p50_ms"] <= single[side]["p99_ms"]
    assert data["ratio"] == pytest.approx(
        single["agent"]["p50_ms"] / single["baseline"]["p50_ms"], rel=1e-3
    )
    assert data["p99_ratio"] == pytest.approx(
        single["agent"]["p99_ms"] / single["baseline"]["p99_ms"], rel=1e-3
    )
    assert data["growth"] == pytest.approx(
        single["agent"]["p50_ms"] / single["agent_kept_0"]["p50_ms"], rel=1e-3
    )
    assert data["met_target"] == (
        data["ratio"] <= TARGET_RATIO
        and data["p99_ratio"] <= TARGET_P99_RATIO
        and data["growth"] <= TARGET_GROWTH
    )
    # The station kept what it was filled with before timing, and every timed image of
    # the full agent (and the fill) left a durable prediction record.
    assert data["station_before_timing"]["images"] == 40
    assert data["predictions_persisted"] >= 40 + 3 * 16
    # The batched measurement stays: one commit per batch.
    batched = data["batched"]
    assert batched["batch_size"] == 8
    assert batched["commits"] == batched["batches"] == 3 * 2
    assert batched["agent_ms_per_image"] > 0 and batched["raw_ort_ms_per_image"] > 0
    assert data["machine"]["cpu_count"] >= 1
    if path.startswith("inbox"):
        # The watch loop's own wait for a landed file: on its event it is not held for
        # the scans' settle time (0.2 s at the defaults) as it is without events.
        arrival = single["arrival"]
        assert arrival["events"]["files"] == arrival["scan"]["files"] == 16
        assert arrival["scan"]["p50_ms"] >= 200.0
        assert arrival["events"]["p50_ms"] < arrival["scan"]["p50_ms"] / 4


def test_an_unknown_path_is_refused_with_the_choices(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "inference", "--path", "grpc", *SMALL])
    assert result.exit_code != 0
    assert "library, api, inbox" in result.output

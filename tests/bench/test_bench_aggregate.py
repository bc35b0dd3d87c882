"""``fedge bench aggregate`` at a tiny size (5 replies x 100k params), through the CLI.

Real child processes, real Flower ``Message``s, ``StreamingFedAvg.run_round`` and
``FedAvg.aggregate_train``: the JSON contract, the agreement of the two results and the
memory ordering are checked exactly as at full size (200 x 10M, see BENCHMARKS.md).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from fedge.cli.main import app

pytestmark = pytest.mark.integration

UPDATES = 5
PARAMS = 100_000
# Holding 1 reply at a time vs all 5 is ~4 vs ~8 model sizes at this size (fixed costs such
# as the fold's 256 KiB scratch buffer weigh more on a 400 kB model); the margin keeps
# allocator noise from deciding the comparison.
MARGIN = 0.75
KEYS = {
    "benchmark",
    "updates",
    "params",
    "model_bytes",
    "peak_rss_over_model",
    "seconds",
    "flower_seconds",
    "flower_peak_rss_over_model",
    "fold_peak_rss_over_model",
    "max_abs_diff",
    "tolerance",
    "agree",
    "max_abs_err_vs_float64",
    "met_target",
    "ours",
    "flower",
    "fold",
    "machine",
}
SIDE_KEYS = {
    "peak_rss_over_model",
    "baseline_rss_bytes",
    "peak_rss_bytes",
    "seconds",
    "generate_seconds",
    "replies_generated",
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench-aggregate") / "out.json"
    args = ["bench", "aggregate", "--updates", str(UPDATES), "--params", str(PARAMS)]
    invoked = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert invoked.exit_code == 0, invoked.output
    data: dict[str, Any] = json.loads(out.read_text())
    assert '"benchmark": "aggregate"' in invoked.stdout  # stdout carries the same JSON
    return data


def test_reports_both_sides(result: dict[str, Any]) -> None:
    assert set(result) >= KEYS
    assert result["benchmark"] == "aggregate"
    assert result["updates"] == UPDATES
    assert result["params"] == PARAMS
    assert sum(result["array_sizes"]) == PARAMS
    assert result["model_bytes"] == 4 * PARAMS
    for side in ("ours", "flower", "fold"):
        info = result[side]
        assert set(info) >= SIDE_KEYS
        assert info["replies_generated"] == UPDATES  # every reply arrived, one at a time
        assert info["peak_rss_over_model"] > 0
        assert info["peak_rss_bytes"] > info["baseline_rss_bytes"] > 0
        assert info["seconds"] >= 0
    assert result["peak_rss_over_model"] == result["ours"]["peak_rss_over_model"]
    assert result["flower_peak_rss_over_model"] == result["flower"]["peak_rss_over_model"]
    machine = result["machine"]
    assert machine["cpu_count"] >= 1
    assert machine["versions"]["flwr"]


def test_results_agree(result: dict[str, Any]) -> None:
    assert result["agree"] is True
    assert result["max_abs_diff"] <= result["tolerance"]
    assert result["fold_max_abs_diff"] <= result["tolerance"]
    # float32 means of 5 replies: far tighter than the worst-case bound in practice.
    assert result["max_abs_diff"] < 1e-5
    for side in ("ours", "flower", "fold"):
        assert result["max_abs_err_vs_float64"][side] < 1e-5


def test_fold_uses_less_memory_than_flower(result: dict[str, Any]) -> None:
    # Flower holds all 5 replies before aggregating; the fold holds one at a time.
    assert result["fold_peak_rss_over_model"] < MARGIN * result["flower_peak_rss_over_model"]


def test_streaming_round_uses_less_memory_than_flower(result: dict[str, Any]) -> None:
    assert result["peak_rss_over_model"] < MARGIN * result["flower_peak_rss_over_model"]

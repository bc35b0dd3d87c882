"""``fedge bench sim-scale`` at a tiny size via the CLI: a fresh process per size, the
JSON contract, and that its figures are measurements (the speed and memory at 1,000 and
10,000 parties are BENCHMARKS.md's business, not this test's)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.cli.main import app

pytestmark = pytest.mark.integration


def test_bench_sim_scale_prints_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    args = ["bench", "sim-scale", "--parties", "60,30", "--rounds", "2", "--peer-max", "0"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    assert written["benchmark"] == "sim-scale" and written["machine"]["cpu_count"] >= 1
    sizes = written["sizes"]
    assert [size["parties"] for size in sizes] == [30, 60]  # smallest first
    for size in sizes:
        assert size["backend"] == "inprocess" and size["per_round"] == 20
        assert size["seconds_per_round"] > 0 and size["peak_rss_mb"] >= size["baseline_rss_mb"]
        assert size["peer_flower"] is None and "peer-max" in size["peer_skipped"]
        assert 0 < size["final_accuracy"] <= 1
    assert written["time_growth"] == pytest.approx(
        sizes[1]["seconds_per_round"] / sizes[0]["seconds_per_round"], abs=1e-3
    )
    assert written["allowed_growth"] == 2.4  # 60 / 30 with 20 % to spare
    assert isinstance(written["met_target"], bool)


def test_bad_sizes_are_refused_before_anything_runs(tmp_path: Path) -> None:
    for sizes, message in (("10,x", "comma-separated"), ("0", "sizes >= 1")):
        result = CliRunner().invoke(app, ["bench", "sim-scale", "--parties", sizes])
        assert result.exit_code != 0
        assert message in result.output, result.output

"""``fedge bench secagg`` at a tiny size (4 parties, 1 timed round), via the CLI.

Real Ray through Flower's simulation runtime: the JSON contract, that SecAgg+'s model
agrees with plain FedAvg's within the quantization bound, and that the dropout round
survived. The timing ratio is BENCHMARKS.md's business, not this test's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.cli.main import app

pytestmark = pytest.mark.integration

KEYS = {
    "machine",
    "seconds_per_round",
    "plain_seconds_per_round",
    "ratio",
    "max_abs_error",
    "error_bound",
    "dropouts_survived",
}


def test_bench_secagg_prints_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "secagg.json"
    # The silent-dropout round on real processes has its own test
    # (tests/aggregator/privacy/test_secagg_silent_dropout.py): skipped here.
    args = ["bench", "secagg", "--parties", "4", "--params", "500", "--rounds", "1"]
    args += ["--silent-parties", "0"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    assert set(written) >= KEYS
    assert written["parties"] == 4 and written["params"] == 500
    assert written["seconds_per_round"] > 0 and written["plain_seconds_per_round"] > 0
    assert 0 <= written["max_abs_error"] <= written["error_bound"] < 1e-3
    assert written["dropouts_survived"] == 1
    assert written["silent_dropouts_survived"] is None and written["silent"] == "skipped"


def test_bench_secagg_refuses_too_few_parties() -> None:
    # One is killed in the dropout round; SecAgg+ never unmasks fewer than 3 (issue 24).
    result = CliRunner().invoke(app, ["bench", "secagg", "--parties", "3"])
    assert result.exit_code != 0
    assert "--parties" in result.output

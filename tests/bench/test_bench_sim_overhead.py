"""``fedge bench sim-overhead`` at a tiny size (1 repetition, 2 timed rounds), via the CLI.

Real Ray through Flower's simulation runtime, our tiered strategy and Flower's FedAvg on
the same echo ClientApp: the JSON contract and that every side ran every round are
checked; the targets (>= 10x, <= 1.2x) are BENCHMARKS.md's business, not this test's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from fedge.cli.main import app

pytestmark = pytest.mark.integration

PARTIES = 6
PER_ROUND = 3
ROUNDS = 2
KEYS = {
    "benchmark",
    "inprocess_s_per_party_round",
    "ours_on_flower_s_per_party_round",
    "flower_fedavg_s_per_party_round",
    "inprocess_speedup",
    "strategy_overhead_ratio",
    "target_inprocess_speedup",
    "target_strategy_overhead_ratio",
    "met_target",
    "runs",
    "diagnostics",
    "runtime_ready_s",
    "machine",
}
SIDES = ("inprocess", "ours_on_flower", "flower_fedavg", "inprocess_pull_1ms")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench-sim-overhead") / "out.json"
    args = [
        "bench",
        "sim-overhead",
        "--parties",
        str(PARTIES),
        "--per-round",
        str(PER_ROUND),
        "--rounds",
        str(ROUNDS),
        "--repeats",
        "1",
        "--params",
        "100",
    ]
    invoked = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert invoked.exit_code == 0, invoked.output
    data: dict[str, Any] = json.loads(out.read_text())
    assert '"benchmark": "sim-overhead"' in invoked.stdout  # stdout carries the same JSON
    return data


def test_reports_every_side(result: dict[str, Any]) -> None:
    assert set(result) >= KEYS
    assert result["benchmark"] == "sim-overhead"
    for key in (
        "inprocess_s_per_party_round",
        "ours_on_flower_s_per_party_round",
        "flower_fedavg_s_per_party_round",
        "inprocess_speedup",
        "strategy_overhead_ratio",
        "runtime_ready_s",
    ):
        assert result[key] > 0, key
    assert isinstance(result["met_target"], bool)
    assert result["diagnostics"]["inprocess_pull_1ms_s_per_party_round"] > 0
    machine = result["machine"]
    assert machine["cpu_count"] >= 1
    assert machine["versions"]["flwr"]
    assert machine["versions"]["ray"]


def test_every_run_timed_every_round(result: dict[str, Any]) -> None:
    for side in SIDES:
        (run,) = result["runs"][side]
        assert run["timed_rounds"] == ROUNDS
        assert run["party_rounds"] == ROUNDS * PER_ROUND
        assert run["s_per_party_round"] > 0
        assert run["timed_s"] > 0

"""``fedge bench console`` at a tiny size via the CLI: real Mosquitto, ``manager serve``'s
service, one real agent and the console over HTTP. The JSON contract and that every
figure is a measurement; the speed is BENCHMARKS.md's business, not this test's."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.bench.console_fleet import plan
from fedge.cli.main import app

pytestmark = pytest.mark.integration


def test_bench_console_prints_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "console.json"
    args = ["bench", "console", "--edges", "12", "--samples", "5", "--changes", "2"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    assert written["benchmark"] == "console" and written["machine"]["cpu_count"] >= 1
    # The plant-like fleet's predictions as the manager's ingest stored them (one batch lost).
    planned = sum(plan(i).delivered for i in range(1, 12))
    assert written["edges"] == 12 and written["predictions"] == planned > 0
    for part, n in (
        ("fleet_page", 5),
        ("peer_static_file", 5),
        ("peer_table_queries", 5),
        ("live_update", 2),
        ("peer_store_applied", 2),
        ("store_to_page", 2),
    ):
        figures = written[part]
        assert figures["n"] == n, part
        assert 0 < figures["p50_ms"] <= figures["p95_ms"] <= figures["max_ms"], part
    assert written["fleet_page_p95_ms"] == written["fleet_page"]["p95_ms"]
    assert written["live_update_p95_ms"] == written["live_update"]["p95_ms"]
    # A change reaches the page only after the store has it.
    assert written["live_update"]["p50_ms"] >= written["peer_store_applied"]["p50_ms"]
    assert written["fleet_page_vs_queries_p95"] > 0
    assert isinstance(written["met_target"], bool)

"""``fedge bench heartbeat`` at a small size, through the CLI, with real components (issue
27, item 6): both sides measured, the heartbeats really stored, and every cut station
lost within the target while none that kept beating was."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.bench.heartbeat import cpu_seconds
from fedge.bench.heartbeat_publisher import phases
from fedge.cli.main import app


def test_phases_spread_the_stations_over_one_interval() -> None:
    assert phases(["a", "b", "c", "d"], 2.0, 10.0) == {"a": 10.0, "b": 10.5, "c": 11.0, "d": 11.5}


def test_cpu_seconds_reads_this_process() -> None:
    before = cpu_seconds("self")
    sum(i * i for i in range(300_000))
    assert cpu_seconds("self") > before >= 0


@pytest.mark.integration
def test_heartbeat_bench_measures_both_sides_and_the_cut(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = ["bench", "heartbeat", "--edges", "40", "--phase", "6", "--workers", "2", "--cut", "4"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    on, off = data["sides"]["on"], data["sides"]["off"]
    # 40 stations, one birth each 2.5 s: about 16 a second, every one stored.
    assert 10 <= data["messages_per_s"] <= 20
    assert off["liveness_stored"] == 0 and off["heartbeats_sent"] == 0
    assert on["heartbeats_sent"] >= on["liveness_stored"] > 0
    assert on["lost_while_beating"] == 0
    assert len(on["loss_visible_s"]) == 4
    assert 7.0 <= data["loss_visible_s_max"] <= 10.0
    assert data["met_target"] is True
    # Mosquitto may use under one clock tick for 16 messages a second over 6 s.
    assert data["broker_cpu_pct"] >= 0 and data["manager_cpu_pct"] > 0
    assert "machine" in data

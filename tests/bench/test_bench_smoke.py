"""Each ``fedge bench`` command at a tiny size, through the CLI, with real components.

Real Mosquitto, SQLite, ONNX Runtime and helper processes; the sizes are small so the
three run in well under a minute, but the JSON contract and the exactly-once and
convergence guarantees are checked exactly as at full size. ``--tls`` runs (issue 13)
are checked to hold both fleets, and that the TLS one really was mutual TLS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedge.cli.main import app

pytestmark = pytest.mark.integration

MACHINE_KEYS = {"hostname", "platform", "python", "cpu_count", "cpu_model", "ram_total_bytes"}
VERSION_KEYS = {"onnxruntime", "paho-mqtt", "mosquitto"}


def run_bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["bench", *args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(out.read_text())
    # stdout carries the same JSON (the status line goes to stderr).
    assert f'"benchmark": "{data["benchmark"]}"' in result.stdout
    return data


def check_machine(data: dict[str, Any]) -> None:
    machine = data["machine"]
    assert set(machine) >= MACHINE_KEYS
    assert set(machine["versions"]) >= VERSION_KEYS
    assert machine["versions"]["mosquitto"].startswith("mosquitto")
    assert machine["cpu_count"] >= 1


PLAIN_BROKER = {
    "require_certificate": False,
    "use_identity_as_username": False,
    "password_file": True,
}
TLS_BROKER = {"require_certificate": True, "use_identity_as_username": True, "password_file": False}


def check_config_push(data: dict[str, Any], edges: int) -> None:
    assert data["edges"] == edges
    assert data["converged"] == edges
    assert data["edge_errors"] == 0
    assert 0 < data["p50_s"] <= data["p99_s"] <= data["max_s"]
    assert all(run["converged"] == edges for run in data["runs"])


def test_config_push_converges(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "config-push", "--edges", "20", "--repeats", "1", "--workers", "2")
    assert {"edges", "p50_s", "p99_s", "max_s", "converged", "machine", "runs"} <= set(data)
    check_config_push(data, 20)
    (run,) = data["runs"]
    assert run["version"] == 2  # v1 was applied before the measured push
    assert run["converged"] == 20
    breakdown = run["breakdown"]
    assert breakdown["edge_received"]["p50_s"] > 0
    assert breakdown["manager_publish_acked"]["max_s"] > 0
    # Without --tls: one plain fleet, on passwords.
    assert data["transport"] == "plain"
    assert data["broker"] == PLAIN_BROKER
    assert data["edge_sessions_on_tls"] == 0
    assert "plain" not in data and "tls_over_plain" not in data
    check_machine(data)


def test_config_push_tls_beside_plain(tmp_path: Path) -> None:
    data = run_bench(
        tmp_path, "config-push", "--edges", "10", "--repeats", "1", "--workers", "2", "--tls"
    )
    # Top level: the mutual-TLS fleet; every edge session presented its certificate to a
    # broker that requires one and has no passwords at all.
    assert data["transport"] == "mutual TLS"
    check_config_push(data, 10)
    assert data["broker"] == TLS_BROKER
    assert data["edge_sessions_on_tls"] == 10
    # Beside it, the plain fleet of the same invocation, and the ratios.
    plain = data["plain"]
    assert plain["transport"] == "plain"
    check_config_push(plain, 10)
    assert plain["broker"] == PLAIN_BROKER
    assert plain["edge_sessions_on_tls"] == 0
    ratios = data["tls_over_plain"]
    assert ratios["p50"] == pytest.approx(data["p50_s"] / plain["p50_s"], rel=1e-3)
    assert ratios["p99"] == pytest.approx(data["p99_s"] / plain["p99_s"], rel=1e-3)
    check_machine(data)


def test_ingest_stores_every_record_once(tmp_path: Path) -> None:
    data = run_bench(
        tmp_path, "ingest", "--records", "5000", "--repeats", "1", "--duplicate-fraction", "0.1"
    )
    assert {"records_per_s", "lost", "duplicated", "records", "seconds", "batch_records"} <= set(
        data
    )
    assert data["records"] == 5000
    assert data["lost"] == 0
    assert data["duplicated"] == 0
    (run,) = data["runs"]
    # Duplicates were really sent, and the manager dropped each of them.
    assert run["duplicates_sent"] >= 1
    assert run["duplicates_dropped"] == run["duplicates_sent"]
    assert run["rejected"] == 0
    assert data["seconds"] > 0
    assert data["records_per_s"] > 0
    assert data["transport"] == "plain"
    assert run["broker"] == PLAIN_BROKER
    check_machine(data)


def test_ingest_tls_beside_plain(tmp_path: Path) -> None:
    data = run_bench(
        tmp_path,
        "ingest",
        "--records",
        "2000",
        "--edges",
        "4",
        "--repeats",
        "1",
        "--duplicate-fraction",
        "0.1",
        "--tls",
    )
    assert data["transport"] == "mutual TLS"
    assert data["plain"]["transport"] == "plain"
    for side, broker in ((data, TLS_BROKER), (data["plain"], PLAIN_BROKER)):
        assert side["records"] == 2000
        assert side["lost"] == 0
        assert side["duplicated"] == 0
        assert side["records_per_s"] > 0
        (run,) = side["runs"]
        assert run["broker"] == broker
        assert run["duplicates_sent"] >= 1
        assert run["duplicates_dropped"] == run["duplicates_sent"]
        assert run["rejected"] == 0
    ratio = data["tls_over_plain"]["records_per_s"]
    assert ratio == pytest.approx(data["records_per_s"] / data["plain"]["records_per_s"], rel=1e-3)
    check_machine(data)

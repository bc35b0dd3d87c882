"""Each ``fedge bench`` command at a tiny size, through the CLI, with real components.

Real Mosquitto, SQLite, ONNX Runtime and helper processes; the sizes are small so the
three run in well under a minute, but the JSON contract and the exactly-once and
convergence guarantees are checked exactly as at full size.
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


def test_config_push_converges(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "config-push", "--edges", "20", "--repeats", "1", "--workers", "2")
    assert {"edges", "p50_s", "p99_s", "max_s", "converged", "machine", "runs"} <= set(data)
    assert data["edges"] == 20
    assert data["converged"] == 20
    assert data["edge_errors"] == 0
    assert 0 < data["p50_s"] <= data["p99_s"] <= data["max_s"]
    (run,) = data["runs"]
    assert run["version"] == 2  # v1 was applied before the measured push
    assert run["converged"] == 20
    breakdown = run["breakdown"]
    assert breakdown["edge_received"]["p50_s"] > 0
    assert breakdown["manager_publish_acked"]["max_s"] > 0
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
    check_machine(data)


def test_inference_compares_agent_with_raw_ort(tmp_path: Path) -> None:
    data = run_bench(
        tmp_path,
        "inference",
        "--images",
        "20",
        "--rounds",
        "3",
        "--per-round",
        "20",
        "--batch-size",
        "8",
        "--image-size",
        "32",
        "--epochs",
        "1",
        "--train-images",
        "256",
    )
    assert {"ratio", "batched", "single", "images", "model"} <= set(data)
    assert data["images"] == 20
    assert data["image_size"] == 32
    assert data["image_shape"] == [32, 32]
    assert data["model"]["image_size"] == 32
    assert data["model"]["onnx_bytes"] > 0
    for side in ("single", "batched"):
        assert data[side]["agent_ms_per_image"] > 0
        assert data[side]["raw_ort_ms_per_image"] > 0
        assert len(data[side]["per_round_ms"]["agent"]) == 3
    assert data["ratio"] == data["batched"]["ratio"] > 0
    # 20 images per round in batches of 8: 3 batches a round, each one commit.
    assert data["batched"]["batch_size"] == 8
    assert data["batched"]["commits"] == data["batched"]["batches"] == 9
    # Every scored image left a prediction record in the agent's outbox.
    assert data["predictions_persisted"] >= 2 * 3 * 20
    check_machine(data)

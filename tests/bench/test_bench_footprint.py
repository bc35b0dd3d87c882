"""``fedge bench agent-footprint``: a real inference-only agent's memory and imports.

The install-size closure is checked on its own (it reads the installed distributions),
then the whole benchmark runs at a small size through the CLI: Mosquitto, the manager
service, a ``fedge agent run`` process, a deployment and scored images.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.bench.footprint import TARGET_RSS_MB, dependency_closure, install_size
from fedge.cli.main import app

BASE = {"paho-mqtt", "grpcio", "protobuf", "onnxruntime", "numpy", "sqlite-utils", "pillow"}
TRAINING = {"torch", "flwr", "onnx", "scikit-learn", "matplotlib", "ray"}


def test_the_agent_closure_holds_the_base_dependencies_and_no_training_stack() -> None:
    found, missing = dependency_closure("fedge", ["agent"])
    assert missing == []
    assert set(found) >= {"fedge", *BASE, "cryptography", "typer", "rich"}
    assert not set(found) & TRAINING


def test_the_agent_train_closure_adds_torch_and_plain_flower() -> None:
    found, missing = dependency_closure("fedge", ["agent-train"])
    assert missing == []
    assert set(found) >= {"torch", "flwr", "onnx", *BASE}
    assert not set(found) & {"ray", "scikit-learn", "matplotlib"}, "no simulation, no plots"


def test_install_size_sums_the_distributions() -> None:
    size = install_size(["agent"])
    assert size["missing"] == []
    assert size["distributions"]["onnxruntime"] > 1
    rounding = 0.005 * len(size["distributions"]) + 0.05  # each to 0.01 MB, the total to 0.1
    assert size["mb"] == pytest.approx(sum(size["distributions"].values()), abs=rounding)


@pytest.mark.integration
def test_agent_footprint_runs_an_inference_only_agent(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(
        app, ["bench", "agent-footprint", "--images", "20", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert '"benchmark": "agent-footprint"' in result.stdout
    assert data["imports_torch"] is False
    assert data["imports_flwr"] is False
    assert 20 < data["agent_rss_mb"] <= TARGET_RSS_MB
    assert data["agent_peak_rss_mb"] >= data["agent_rss_mb"]
    assert data["images_scored"] == 20
    assert data["met_target"] is True
    assert 0 < data["install_mb"] < data["agent_train_install_mb"]
    assert {"hostname", "cpu_count", "versions"} <= set(data["machine"])

"""The agent's serving state: what serves now, changed by install and commit only.

A real ONNX model loaded by the agent's runtime; the state itself is plain values.
"""

import hashlib
import threading
from pathlib import Path

import pytest

from fedge.edge_agent.config.decisions import ThresholdSource
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.serving import ServingState
from fedge.models.tiny_onnx import build_linear_classifier
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import ModelManifest, TensorSpec


def _model(tmp_path: Path, version: int) -> runtime.LoadedModel:
    path = tmp_path / f"inspect-{version}.onnx"
    build_linear_classifier(path, seed=version)
    manifest = ModelManifest(
        name="inspect",
        version=version,
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        size=path.stat().st_size,
        inputs=(TensorSpec("image", "float32", ("batch", 1, 32, 32)),),
        outputs=(TensorSpec("probs", "float32", ("batch", 2)),),
        classes=("clean", "scratch"),
        positive_classes=("scratch",),
    )
    return runtime.load(path, manifest)


def _config(version: int, threshold: float, model: str | None = None) -> EdgeConfig:
    return EdgeConfig(
        fleet="plant-a", edge="st-01", version=version, default_threshold=threshold, model=model
    )


def test_nothing_serves_and_no_config_applies_at_first() -> None:
    state = ServingState(threading.Lock())
    assert (state.model, state.config, state.ref, state.applied_version) == (None, None, "", 0)
    assert state.session == -1
    assert state.thresholds().source is ThresholdSource.DEFAULT


def test_a_deployment_swaps_the_model_and_keeps_the_config_in_force(tmp_path: Path) -> None:
    applied = _config(3, 0.7)
    state = ServingState(threading.Lock(), config=applied, session=4)
    with state.lock:
        state.install(_model(tmp_path, 1))
    assert state.ref == "inspect:1" and state.config is applied and state.applied_version == 3
    assert state.session == 4
    thresholds = state.thresholds()
    assert (thresholds.default_threshold, thresholds.model) == (0.7, "inspect:1")


def test_a_rollback_brings_the_previous_models_config_back(tmp_path: Path) -> None:
    state = ServingState(threading.Lock(), config=_config(5, 0.9, model="inspect:2"))
    state.install(_model(tmp_path, 2))
    back = _config(4, 0.6, model="inspect:1")
    with state.lock:
        state.install(_model(tmp_path, 1), back)
    assert state.ref == "inspect:1" and state.config is back and state.applied_version == 4
    assert state.thresholds().source is ThresholdSource.CONFIG


def test_a_committed_config_is_in_force_for_the_model_serving(tmp_path: Path) -> None:
    state = ServingState(threading.Lock(), model=_model(tmp_path, 1))
    with state.lock:
        state.commit(_config(2, 0.8, model="inspect:1"))
    assert state.ref == "inspect:1" and state.applied_version == 2
    assert state.thresholds().default_threshold == pytest.approx(0.8)

"""Execution providers from the station's configuration (issue 25, item 11).

The choice is a pure function over what the station asks for and what this ONNX Runtime
build offers; the rest is agent.toml parsing and a real session reporting what serves."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnxruntime as ort
import pytest
from conftest import make_fleet_home

from fedge.edge_agent.errors import SettingsError
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.settings import load_settings
from fedge.edge_agent.training.spec import supernode_spec
from fedge.models.tiny_onnx import build_linear_classifier
from fedge.protocols.app_signing import trusted_entities_yaml
from fedge.protocols.config import EdgeConfig, TrainingPolicy
from fedge.protocols.manifest import ModelManifest, TensorSpec
from fedge.protocols.signing import SigningKey

CUDA, TRT, OPENVINO, CPU = (
    "CUDAExecutionProvider",
    "TensorrtExecutionProvider",
    "OpenVINOExecutionProvider",
    "CPUExecutionProvider",
)


def test_the_stations_order_where_offered_and_the_cpu_always_last() -> None:
    assert runtime.choose_providers([TRT, CUDA], [CUDA, TRT, CPU]) == [TRT, CUDA, CPU]
    assert runtime.choose_providers([TRT, CUDA], [CUDA, CPU]) == [CUDA, CPU]
    assert runtime.choose_providers([OPENVINO], [CPU]) == [CPU]
    assert runtime.choose_providers([], [CUDA, CPU]) == [CPU]
    # Named twice, or the CPU named first: once, and last.
    assert runtime.choose_providers([CPU, CUDA, CUDA], [CUDA, CPU]) == [CUDA, CPU]


def test_agent_toml_names_providers_and_unknown_names_are_refused(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    try:
        path = fh.agents["st-01"]
        assert load_settings(path).execution_providers == (CUDA,)  # the default
        base = path.read_text()
        path.write_text(base + f'execution_providers = ["{TRT}", "{CUDA}"]\n')
        assert load_settings(path).execution_providers == (TRT, CUDA)
        path.write_text(base + 'execution_providers = ["QuantumExecutionProvider"]\n')
        with pytest.raises(SettingsError, match="unknown execution provider"):
            load_settings(path)
        path.write_text(base + 'execution_providers = "CUDAExecutionProvider"\n')
        with pytest.raises(SettingsError, match="must be a list"):
            load_settings(path)
    finally:
        fh.close()


def test_a_loaded_model_says_which_provider_serves(tmp_path: Path) -> None:
    path = build_linear_classifier(tmp_path / "m.onnx", seed=1)
    manifest = ModelManifest(
        name="inspect",
        version=1,
        sha256="0" * 64,
        size=1,
        inputs=(TensorSpec("image", "float32", ("batch", 1, 32, 32)),),
        outputs=(TensorSpec("probs", "float32", ("batch", 2)),),
        classes=("clean", "scratch"),
    )
    model = runtime.load(path, manifest, (TRT, CUDA))
    expected = runtime.choose_providers((TRT, CUDA), ort.get_available_providers())[0]
    assert model.provider == expected
    if CUDA not in ort.get_available_providers():  # this project's CI machines
        assert model.provider == CPU


def test_the_supernode_runs_only_apps_the_trusted_key_signed_and_a_rotation_restarts_it(
    tmp_path: Path,
) -> None:
    """Issue 24: the SuperNode's trusted entities are the manager key the agent trusts; a
    rotation gives a different spec, which the supervisor restarts the SuperNode for."""
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    try:
        settings = load_settings(fh.agents["st-01"])  # enrolment names the SuperLink
        config = EdgeConfig(
            "plant-a", "st-01", 1, training=TrainingPolicy(enabled=True, max_minutes=1)
        )
        old, new = SigningKey.generate().public, SigningKey.generate().public
        before = supernode_spec(settings, config, Counter(), app_keys=(old,))
        after = supernode_spec(settings, config, Counter(), app_keys=(new,))
        assert before is not None and after is not None
        assert before.trusted_entities == trusted_entities_yaml(old)
        assert before != after  # a changed spec: the supervisor restarts the SuperNode
        assert before.privacy_floor  # enrolment wrote a floor: the ClientApp requires it
    finally:
        fh.close()

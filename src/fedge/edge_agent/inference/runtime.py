"""ONNX Runtime adapter: load a verified model, smoke-test it, run it.

Execution providers come from the station's configuration (``execution_providers`` in
agent.toml: the accelerators it may use, in order of preference; CUDA by default), each
used only where this machine's ONNX Runtime build offers it, and the CPU always last, so a
model loads everywhere. The choice is made at load time, not at install time; the provider
that serves is reported in the agent's status and telemetry (issue 25).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from fedge.edge_agent.errors import DeployError, InferenceError
from fedge.protocols.manifest import ModelManifest

_NUMPY_DTYPES: dict[str, type[np.floating]] = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
}


CPU_PROVIDER = "CPUExecutionProvider"
DEFAULT_PROVIDERS: tuple[str, ...] = ("CUDAExecutionProvider",)


def choose_providers(preferred: Sequence[str], available: Sequence[str]) -> list[str]:
    """The providers to load a model with: ``preferred`` in order where ``available``,
    then the CPU (always last, and only once)."""
    chosen = [p for p in dict.fromkeys(preferred) if p in available and p != CPU_PROVIDER]
    return [*chosen, CPU_PROVIDER]


def providers(preferred: Sequence[str] = DEFAULT_PROVIDERS) -> list[str]:
    """:func:`choose_providers` on this machine's ONNX Runtime build."""
    return choose_providers(preferred, ort.get_available_providers())


@dataclass(frozen=True)
class LoadedModel:
    manifest: ModelManifest
    path: Path
    session: ort.InferenceSession
    input_name: str
    output_name: str
    input_dtype: type[np.floating]
    # An anomaly model served beside this classifier (issue 28): loaded, smoke-tested,
    # swapped and rolled back with it, as one serving pair.
    anomaly: "LoadedModel | None" = None

    @property
    def ref(self) -> str:
        return self.manifest.ref

    @property
    def anomaly_ref(self) -> str:
        """``name:version`` of the anomaly model served beside it ("" when none)."""
        return "" if self.anomaly is None else self.anomaly.ref

    def with_anomaly(self, anomaly: "LoadedModel | None") -> "LoadedModel":
        return replace(self, anomaly=anomaly)

    @property
    def provider(self) -> str:
        """The execution provider that serves (the first ONNX Runtime kept)."""
        return str(self.session.get_providers()[0])

    def run(self, batch: np.ndarray) -> np.ndarray:
        try:
            outputs = self.session.run([self.output_name], {self.input_name: batch})
        except Exception as exc:  # ORT raises untyped runtime errors
            raise InferenceError(f"{self.ref} failed on input {batch.shape}: {exc}") from None
        result: np.ndarray = outputs[0]
        return result


def load(
    path: Path, manifest: ModelManifest, preferred: Sequence[str] = DEFAULT_PROVIDERS
) -> LoadedModel:
    options = ort.SessionOptions()
    # One edge process, one model: don't let ORT spin threads for every core of a shared box.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(path), options, providers=providers(preferred))
    except Exception as exc:
        raise DeployError(
            "load_failed", f"ONNX Runtime cannot load {manifest.ref}: {exc}"
        ) from None
    inputs, outputs = session.get_inputs(), session.get_outputs()
    expected_in, expected_out = manifest.inputs[0], manifest.outputs[0]
    if inputs[0].name != expected_in.name or outputs[0].name != expected_out.name:
        raise DeployError(
            "spec_mismatch",
            f"model has {inputs[0].name}->{outputs[0].name}, manifest says "
            f"{expected_in.name}->{expected_out.name}",
        )
    dtype = _NUMPY_DTYPES.get(expected_in.dtype)
    if dtype is None:
        raise DeployError("spec_mismatch", f"input dtype {expected_in.dtype} is not supported")
    return LoadedModel(manifest, path, session, inputs[0].name, outputs[0].name, dtype)


def check_anomaly(classifier: LoadedModel, anomaly: LoadedModel) -> None:
    """The anomaly model must take the classifier's images as they are (one decode and
    one prepared batch serve both), and give one finite score per image."""
    theirs, ours = anomaly.manifest, classifier.manifest
    if theirs.inputs[0].shape[1:] != ours.inputs[0].shape[1:] or theirs.preprocess not in (
        None,
        ours.preprocess,
    ):
        raise DeployError(
            "anomaly_mismatch",
            f"anomaly model {theirs.ref} takes {theirs.inputs[0].shape} images prepared as "
            f"{theirs.preprocess}, but {ours.ref} takes {ours.inputs[0].shape} prepared as "
            f"{ours.preprocess}; publish it from the classifier's own backbone",
        )
    shape = tuple(d if isinstance(d, int) and d > 0 else 1 for d in theirs.inputs[0].shape)
    try:
        scores = anomaly.run(np.full(shape, 0.5, dtype=anomaly.input_dtype))
    except InferenceError as exc:
        raise DeployError("smoke_test_failed", f"anomaly model: {exc}") from None
    if scores.ndim != 1 or not np.all(np.isfinite(scores)):
        raise DeployError(
            "smoke_test_failed",
            f"anomaly model {theirs.ref}: output shape {scores.shape} or values not one "
            "finite score per image",
        )


def smoke_test(model: LoadedModel) -> None:
    """Run one neutral input; the output must be one finite score per declared class."""
    shape = tuple(d if isinstance(d, int) and d > 0 else 1 for d in model.manifest.inputs[0].shape)
    probe = np.full(shape, 0.5, dtype=model.input_dtype)
    try:
        scores = model.run(probe)
    except InferenceError as exc:
        raise DeployError("smoke_test_failed", str(exc)) from None
    n_classes = len(model.manifest.classes)
    if scores.ndim != 2 or scores.shape[1] != n_classes:
        raise DeployError(
            "smoke_test_failed", f"output shape {scores.shape}, expected (batch, {n_classes})"
        )
    if not np.all(np.isfinite(scores)):
        raise DeployError("smoke_test_failed", "output has NaN or infinite scores")

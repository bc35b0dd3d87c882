"""Small ONNX models built directly with ``onnx.helper`` -- no torch needed.

They share the inspection model's interface (input ``image`` float32
``[batch, 1, size, size]``, output ``probs`` ``[batch, n_classes]``), so unit tests and
tools can exercise the edge's load / smoke-test / swap path in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

INPUT_NAME = "image"
OUTPUT_NAME = "probs"
OPSET_VERSION = 17
# onnx writes its own newest IR version by default, which an older onnxruntime refuses
# to load; 10 is what onnxruntime has accepted since 1.16 and is enough for opset 17.
IR_VERSION = 10


def build_linear_classifier(
    path: Path,
    *,
    size: int = 32,
    n_classes: int = 2,
    seed: int = 0,
    weights: npt.NDArray[np.floating] | None = None,
    bias: npt.NDArray[np.floating] | None = None,
) -> Path:
    """Write ``image -> Flatten -> Gemm -> Softmax -> probs`` to ``path`` and return it.

    ``weights`` has shape ``(n_classes, size * size)`` and ``bias`` ``(n_classes,)``;
    whichever is omitted is drawn from ``seed`` (small values, so the probabilities are
    neither uniform nor saturated). Different weights give different model bytes, which
    is what tests of versioning and swapping need.
    """
    if size < 1 or n_classes < 1:
        raise ValueError(f"size and n_classes must be >= 1, got {size} and {n_classes}")
    features = size * size
    rng = np.random.default_rng(seed)
    if weights is None:
        weights = rng.normal(0.0, 0.05, size=(n_classes, features))
    if bias is None:
        bias = rng.normal(0.0, 0.1, size=(n_classes,))
    w = np.asarray(weights, dtype=np.float32)
    b = np.asarray(bias, dtype=np.float32)
    if w.shape != (n_classes, features):
        raise ValueError(f"weights must have shape {(n_classes, features)}, got {w.shape}")
    if b.shape != (n_classes,):
        raise ValueError(f"bias must have shape {(n_classes,)}, got {b.shape}")

    nodes = [
        helper.make_node("Flatten", [INPUT_NAME], ["flat"], axis=1),
        # transB=1 keeps weights in the (out, in) layout of a torch nn.Linear.
        helper.make_node("Gemm", ["flat", "W", "B"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], [OUTPUT_NAME], axis=1),
    ]
    initializers = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")]
    graph = helper.make_graph(
        nodes,
        "linear_classifier",
        [_image_input(size)],
        [_probs_output(n_classes)],
        initializer=initializers,
    )
    return _save(graph, path)


def build_broken_model(path: Path, *, size: int = 32, n_classes: int = 2) -> Path:
    """Write a model that loads and type-checks but fails on every inference call.

    It has the normal ``image`` / ``probs`` interface, so it passes any static check of
    names and shapes, but it gathers pixel indices past the end of the flattened image.
    Shape inference does not look at index values, so onnxruntime accepts the file and
    only raises when it runs -- for every batch size -- which is exactly what a smoke
    test must catch. (An impossible Reshape is caught at load time instead.)
    """
    if size < 1 or n_classes < 1:
        raise ValueError(f"size and n_classes must be >= 1, got {size} and {n_classes}")
    out_of_range = np.arange(n_classes, dtype=np.int64) + size * size + 7
    nodes = [
        helper.make_node("Flatten", [INPUT_NAME], ["flat"], axis=1),
        helper.make_node("Gather", ["flat", "bad_index"], ["logits"], axis=1),
        helper.make_node("Softmax", ["logits"], [OUTPUT_NAME], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "broken_model",
        [_image_input(size)],
        [_probs_output(n_classes)],
        initializer=[numpy_helper.from_array(out_of_range, "bad_index")],
    )
    return _save(graph, path)


def build_brightness_anomaly(path: Path, *, size: int = 32, scale: float = 20.0) -> Path:
    """Write an anomaly model with the published anomaly models' interface (``image`` in;
    ``score`` ``[batch]`` and ``anomaly_map`` ``[batch, size, size]`` out) whose score is
    the image's mean brightness times ``scale``: bright parts are the anomalies, so a
    test chooses which parts are novel by the images it sends."""
    scale_value = numpy_helper.from_array(np.array(scale, dtype=np.float32), "scale")
    nodes = [
        helper.make_node("ReduceMean", [INPUT_NAME], ["mean"], axes=[1, 2, 3], keepdims=0),
        helper.make_node("Mul", ["mean", "scale"], ["score"]),
        helper.make_node("ReduceMean", [INPUT_NAME], ["plane"], axes=[1], keepdims=0),
        helper.make_node("Mul", ["plane", "scale"], ["anomaly_map"]),
    ]
    graph = helper.make_graph(
        nodes,
        "brightness_anomaly",
        [_image_input(size)],
        [
            helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch"]),
            helper.make_tensor_value_info("anomaly_map", TensorProto.FLOAT, ["batch", size, size]),
        ],
        initializer=[scale_value],
    )
    return _save(graph, path)


def _image_input(size: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", 1, size, size])


def _probs_output(n_classes: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", n_classes])


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET_VERSION)],
        producer_name="fedge.models.tiny_onnx",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path

"""Set-up of the inference benchmark: the model, the decoded images, the agent.

Not timed. The model is the project's scratch-inspection CNN, trained at the benchmark's
image size and exported to ONNX in a child process (``python -m
fedge.bench.inference_setup train``) so that torch's thread pools never share the timed
process; without the training extra a softmax regression built with ``onnx.helper``
stands in. :func:`make_agent` gives a real :class:`EdgeAgent` (MQTT never started) with
the model installed as a deployment would install it.
"""

import argparse
import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from PIL import Image

from fedge.bench.testbed import BenchError
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.inference.images import decode_image
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_manager.registry.onnx_spec import read_spec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import ModelManifest
from fedge.protocols.signing import SigningKey

CLASSES = ("clean", "scratch")
DEFAULT_IMAGE_SIZE = 128


def default_training(image_size: int) -> tuple[int, int]:
    """``(train_images, epochs)`` used when not given: training cost grows with the pixel
    count, so sizes above 32 train on fewer images for fewer epochs (set-up ~1 min on
    2 cores at 128)."""
    return (4000, 3) if image_size <= 32 else (1500, 2)


# ---------------------------------------------------------------- the model


def _train_and_export(
    path: Path, epochs: int, train_images: int, seed: int, image_size: int
) -> dict[str, Any]:
    """Child-process side: train the inspection CNN and export it (imports torch)."""
    from fedge.datasets.defects import make_defect_images
    from fedge.models.inspection import evaluate, export_onnx, train_inspection_model

    images, labels = make_defect_images(train_images, size=image_size, seed=seed)
    model = train_inspection_model(images, labels, epochs=epochs, seed=seed)
    del images, labels
    test_images, test_labels = make_defect_images(500, size=image_size, seed=seed + 1)
    accuracy = evaluate(model, test_images, test_labels)
    export_onnx(model, path, image_size=image_size)
    return {
        "kind": "trained-cnn",
        "architecture": "fedge.models.inspection.InspectionNet",
        "image_size": image_size,
        "epochs": epochs,
        "train_images": train_images,
        "test_accuracy": round(accuracy, 4),
    }


def _synthetic_model(path: Path, image_size: int) -> dict[str, Any]:
    """A softmax regression over the pixels, for installs without torch."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.05, (image_size * image_size, len(CLASSES))).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["image"], ["flat"], axis=1),
            helper.make_node("MatMul", ["flat", "w"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
        ],
        "bench",
        [
            helper.make_tensor_value_info(
                "image", TensorProto.FLOAT, ["batch", 1, image_size, image_size]
            )
        ],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", len(CLASSES)])],
        [numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return {
        "kind": "synthetic-softmax-regression",
        "architecture": "onnx.helper",
        "image_size": image_size,
    }


def build_model(
    path: Path, *, epochs: int, train_images: int, seed: int, image_size: int
) -> dict[str, Any]:
    """Train + export in a child process; fall back to the synthetic graph without torch."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedge.bench.inference_setup",
            "train",
            str(path),
            "--epochs",
            str(epochs),
            "--train-images",
            str(train_images),
            "--seed",
            str(seed),
            "--image-size",
            str(image_size),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if result.returncode == 0:
        info: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
        return info
    if "ModuleNotFoundError" in result.stderr:
        return _synthetic_model(path, image_size)
    raise BenchError(f"training the benchmark model failed: {result.stderr.strip()[-800:]}")


# ---------------------------------------------------------------- images and the agent


def png_images(n: int, seed: int, image_size: int) -> list[bytes]:
    """``n`` inspection images as the PNG files a camera would hand over."""
    try:
        from fedge.datasets.defects import make_defect_images

        raw, _ = make_defect_images(n, size=image_size, seed=seed)
    except ImportError:
        raw = np.random.default_rng(seed).integers(0, 256, (n, image_size, image_size), np.uint8)
    files = []
    for pixels in raw:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        files.append(buffer.getvalue())
    return files


def decoded_images(n: int, seed: int, image_size: int) -> list[np.ndarray]:
    """``n`` inspection images, PNG-encoded and decoded by the agent's own decoder."""
    try:
        from fedge.datasets.defects import make_defect_images

        raw, _ = make_defect_images(n, size=image_size, seed=seed)
    except ImportError:
        raw = np.random.default_rng(seed).integers(0, 256, (n, image_size, image_size), np.uint8)
    images = []
    for pixels in raw:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        images.append(decode_image(buffer.getvalue(), image_size))
    return images


def make_agent(data_dir: Path, model_path: Path, image_size: int) -> EdgeAgent:
    """An agent with the model active and config v1 in force; MQTT is never started."""
    settings = AgentSettings(
        fleet="bench",
        edge="bench-edge",
        data_dir=data_dir,
        broker_host="127.0.0.1",
        broker_port=1,  # never connected
        insecure=True,
        password="unused",
        grpc_target="127.0.0.1:1",
        manager_public_key=SigningKey.generate().public.to_text(),
        image_size=image_size,
    )
    spec = read_spec(model_path)
    manifest = ModelManifest(
        name="bench",
        version=1,
        sha256=hashlib.sha256(model_path.read_bytes()).hexdigest(),
        size=model_path.stat().st_size,
        inputs=spec.inputs,
        outputs=spec.outputs,
        classes=CLASSES,
        positive_classes=("scratch",),
    )
    agent = EdgeAgent(settings)
    model = runtime.load(model_path, manifest)
    runtime.smoke_test(model)
    config = EdgeConfig(fleet="bench", edge="bench-edge", version=1, default_threshold=0.5)
    agent.serving_state.install(model, config)
    return agent


def raw_session(model_path: Path) -> ort.InferenceSession:
    """A bare session with exactly the agent's SessionOptions and providers."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(model_path), options, providers=runtime.providers())


# ---------------------------------------------------------------- child-process entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedge.bench.inference")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the inspection CNN and export it to ONNX")
    train.add_argument("path", type=Path)
    train.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE)
    train.add_argument("--epochs", type=int, help="default: see default_training()")
    train.add_argument("--train-images", type=int, help="default: see default_training()")
    train.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    default_images, default_epochs = default_training(args.image_size)
    info = _train_and_export(
        args.path,
        default_epochs if args.epochs is None else args.epochs,
        default_images if args.train_images is None else args.train_images,
        args.seed,
        args.image_size,
    )
    print(json.dumps(info))


if __name__ == "__main__":
    main()

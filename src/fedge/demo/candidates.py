"""Two candidates a central team might hand the gate, trained here with torch.

- *flipped*: trained on labels flipped by a broken export (clean <-> scratch): it must
  never reach a station, and the validation gate is what stops it.
- *central*: the serving model fine-tuned on central data of every condition the fleet
  has seen (scratches, dents, the new lighting). It is better on the stations' held-out
  images, so the gate blesses it; what the gate cannot know is a condition no held-out
  image shows yet, which is the canary's job.

Both are published with a note in their lineage saying what they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedge.datasets.conditions import lighting_drift
from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.edge_manager.registry.versions import Registry, TrainableSource
from fedge.protocols.manifest import Lineage, Preprocess

IMAGE_SIZE = 32
FAMILY, PARAMS = "inspection-cnn", {"width": 16}


@dataclass(frozen=True)
class Candidate:
    ref: str
    onnx_path: Path
    accuracy: float  # on generated held-out images of every known condition


def _held_out() -> tuple[np.ndarray, np.ndarray]:
    clean, clean_y = make_defect_images(300, seed=901)
    dents, dents_y = make_defect_images(300, seed=902, dent_fraction=0.8)
    lit, lit_y = make_defect_images(300, seed=903)
    return (
        np.concatenate([clean, dents, lighting_drift(lit)]),
        np.concatenate([clean_y, dents_y, lit_y]),
    )


def train_flipped(out: Path, registry: Registry, name: str, version: int) -> Candidate:
    from fedge.models.inspection import cpu_threads, evaluate, export_onnx, train_inspection_model

    images, labels = make_defect_images(800, seed=911)
    with cpu_threads(1):
        model = train_inspection_model(images, 1 - labels, epochs=3, seed=11, device="cpu")
        accuracy = evaluate(model, *_held_out())
    path = out / f"{name}-v{version}-flipped.onnx"
    export_onnx(model, path)
    lineage = Lineage(note="central training; its labels were flipped by a broken export")
    return _publish(registry, name, version, path, accuracy, lineage, None)


def train_central(
    out: Path, registry: Registry, name: str, version: int, start: tuple[str, int]
) -> Candidate:
    """Fine-tune ``start`` (a trainable registry model) on central data of every known
    condition, and publish it (trainable) as ``name:version``."""
    from fedge.models.inspection import cpu_threads, evaluate, export_onnx
    from fedge.party import families, trainer

    parent = registry.get(*start)
    model = families.build(FAMILY, PARAMS, len(CLASSES))
    families.load_state_arrays(model, families.weights_from_bytes(parent.verified_weights()))
    clean, clean_y = make_defect_images(2400, seed=921)
    dents, dents_y = make_defect_images(1200, seed=922, dent_fraction=0.8)
    lit, lit_y = make_defect_images(2400, seed=923, dent_fraction=0.4)
    images = np.concatenate([clean, dents, lighting_drift(lit)])
    labels = np.concatenate([clean_y, dents_y, lit_y])
    examples = trainer.Examples(
        (images.astype(np.float32) / np.float32(255.0))[:, None], labels.astype(np.int64)
    )
    with cpu_threads(1):
        trainer.train(
            model,
            examples,
            trainer.TrainSettings(
                lr=5e-4, epochs=4, batch_size=64, seed=12, augment_symmetries=True
            ),
        )
        accuracy = evaluate(model, *_held_out())
    path = out / f"{name}-v{version}-central.onnx"
    export_onnx(model, path)
    weights = path.with_suffix(".npz")
    weights.write_bytes(families.weights_bytes(families.state_arrays(model)))
    lineage = Lineage(
        parent_version=start[1],
        note="central fine-tune on scratches, dents and the new lighting",
    )
    trainable = TrainableSource(weights, FAMILY, dict(PARAMS))
    return _publish(registry, name, version, path, accuracy, lineage, trainable)


def _publish(
    registry: Registry,
    name: str,
    version: int,
    path: Path,
    accuracy: float,
    lineage: Lineage,
    trainable: TrainableSource | None,
) -> Candidate:
    published = registry.publish(
        path,
        name=name,
        version=version,
        classes=CLASSES,
        positive_classes=("scratch",),
        preprocess=Preprocess(image_size=IMAGE_SIZE),
        lineage=lineage,
        trainable=trainable,
    )
    return Candidate(published.manifest.ref, path, accuracy)

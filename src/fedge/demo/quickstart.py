"""``fedge quickstart``: what the README's walkthrough needs and a new user does not have.

A starter inspection model (the demo's CNN, trained briefly on generated scratch/clean
surfaces, exported to ONNX with its weights so it is also trainable in fleet jobs) and
a handful of generated part images with their true classes, so the walkthrough's
``fedge model publish`` and ``cp`` lines have something to work on. The images need only
numpy and Pillow; the model needs torch (the training side, ``pip install 'fedge[train]'``).
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from pathlib import Path

from fedge.datasets.defects import CLASSES, make_defect_images, write_png_dir

# Seeds apart from the demo's (1, 2, 3, 7, 8, 300+, 400+) and the student's (1000+, 2000+):
# the starter model is never scored on its own training images.
TRAIN_SEED, HELD_OUT_SEED, PARTS_SEED = 501, 502, 503
# Measured on 2 CPU cores: 2000 images x 3 epochs train in about 5 s and reach ~96 %
# held-out accuracy -- good enough to see accepts and rejects, quick enough for a first try.
TRAIN_IMAGES, HELD_OUT_IMAGES, EPOCHS = 2000, 1000, 3
IMAGE_SIZE = 32
WIDTH = 16  # InspectionNet's default width, named at publish: `--param width=16`
PART_PREFIX = "part"


@dataclass(frozen=True)
class StarterModel:
    onnx_path: Path
    weights_path: Path
    held_out_accuracy: float
    held_out_images: int
    train_seconds: float


@dataclass(frozen=True)
class SampleParts:
    directory: Path
    images: tuple[Path, ...]
    truth_csv: Path  # file name -> true class, for labelling as an operator would


def write_sample_parts(directory: Path, count: int, seed: int = PARTS_SEED) -> SampleParts:
    """``count`` generated 32x32 part images (half scratched) and ``truth.csv`` beside them."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    images, labels = make_defect_images(count, size=IMAGE_SIZE, seed=seed)
    paths = write_png_dir(images, directory, PART_PREFIX)
    truth = directory / "truth.csv"
    with truth.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "class"])
        for path, label in zip(paths, labels, strict=True):
            writer.writerow([path.name, CLASSES[int(label)]])
    return SampleParts(directory, tuple(paths), truth)


def train_starter_model(onnx_path: Path, *, seed: int = 0) -> StarterModel:
    """Train the starter CNN on generated surfaces; write ONNX and ``.npz`` weights.

    Imports torch: on an inference-only install this raises ModuleNotFoundError, which
    the CLI turns into "this command needs torch".
    """
    from fedge.models.inspection import cpu_threads, evaluate, export_onnx, train_inspection_model
    from fedge.party.families import state_arrays, weights_bytes

    started = time.monotonic()
    images, labels = make_defect_images(TRAIN_IMAGES, size=IMAGE_SIZE, seed=TRAIN_SEED + seed)
    held_out = make_defect_images(HELD_OUT_IMAGES, size=IMAGE_SIZE, seed=HELD_OUT_SEED + seed)
    # One thread: on a small machine OpenMP contention makes this CNN slower, not faster.
    with cpu_threads(1):
        model = train_inspection_model(images, labels, epochs=EPOCHS, seed=seed, device="cpu")
        accuracy = evaluate(model, *held_out)
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    export_onnx(model, onnx_path, image_size=IMAGE_SIZE)
    weights = onnx_path.with_suffix(".npz")
    weights.write_bytes(weights_bytes(state_arrays(model)))
    return StarterModel(onnx_path, weights, accuracy, HELD_OUT_IMAGES, time.monotonic() - started)

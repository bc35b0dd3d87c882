"""The scratch-inspection CNN: training, evaluation and export to ONNX.

The edge runs only the exported ONNX file with onnxruntime, so the contract that
matters is the exported graph: input ``image`` float32 ``[batch, 1, 32, 32]`` with pixel
values in [0, 1] (uint8 / 255, as ``fedge.party.preprocess.prepare`` makes them), output
``probs`` float32 ``[batch, 2]`` holding softmax probabilities in ``CLASSES`` order.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedge.models.errors import ModelsError

INPUT_NAME = "image"
OUTPUT_NAME = "probs"
OPSET_VERSION = 17
IMAGE_SIZE = 32

_BATCH_SIZE = 64
_LEARNING_RATE = 3e-3
_VERIFY_TOLERANCE = 1e-4


class ModelExportError(ModelsError):
    """The ONNX export failed or its output disagrees with the torch model."""


class InspectionNet(nn.Module):
    """A small CNN classifying 1x32x32 surface images; returns logits.

    Three 3x3 conv stages and a global max-pool: a scratch is a thin local feature that
    may sit anywhere, so the strongest response anywhere in the image is what decides.
    """

    def __init__(self, n_classes: int = 2, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 32 -> 16
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16 -> 8
            nn.Conv2d(2 * width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(2 * width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Per-image centering: surfaces differ in overall brightness, scratches do not
        # depend on it, and this keeps the edge's input contract a plain [0, 1] image.
        x = x - x.mean(dim=(2, 3), keepdim=True)
        x = x / (x.std(dim=(2, 3), keepdim=True) + 1e-3)
        features = self.features(x)
        pooled = torch.amax(features, dim=(2, 3))
        logits: torch.Tensor = self.head(pooled)
        return logits


class _ProbabilityHead(nn.Module):
    """Wraps a logits model so the exported graph outputs softmax probabilities."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.net(x), dim=1)


def default_device() -> str:
    """The device to train on, decided at run time rather than at import."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Run torch's CPU ops on ``n`` intra-op threads inside the block, then restore.

    These CNNs are so small that splitting one op over threads gains little and, on a
    busy two-core machine (the demo runs a broker, a manager and three agents beside
    it), OpenMP's spinning threads cost far more: a width-4 training step on a batch of
    64 measured 17 ms on one thread and 340 ms on two while two other processes were
    busy. One thread also makes results independent of the machine's core count.
    """
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def new_model(seed: int, *, n_classes: int = 2, width: int = 16) -> InspectionNet:
    """A freshly initialised ``InspectionNet``, the same for a seed, wherever it trains.

    ``fork_rng`` restores the CPU generator afterwards, so making a model does not
    perturb the caller's randomness; init happens on the CPU so the weights are the same
    whichever device trains them.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return InspectionNet(n_classes=n_classes, width=width)


def images_to_tensor(images: npt.NDArray[np.generic]) -> torch.Tensor:
    """Convert ``(n, h, w)`` or ``(n, 1, h, w)`` images to float32 NCHW in [0, 1].

    uint8 input is scaled by 1/255; float input is taken to be in [0, 1] already.
    """
    if images.ndim == 3:
        images = images[:, None, :, :]
    if images.ndim != 4 or images.shape[1] != 1:
        raise ValueError(f"expected images of shape (n, h, w) or (n, 1, h, w), got {images.shape}")
    if images.dtype == np.uint8:
        array = images.astype(np.float32) / np.float32(255.0)
    else:
        array = images.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(array))


def train_inspection_model(
    images: npt.NDArray[np.generic],
    labels: npt.NDArray[np.integer],
    *,
    epochs: int,
    seed: int,
    device: str | None = None,
) -> InspectionNet:
    """Train an ``InspectionNet`` with Adam on mini-batches of 64.

    ``images`` are uint8 (scaled by 1/255) or float in [0, 1], shaped ``(n, h, w)`` or
    ``(n, 1, h, w)``; each batch gets a random flip / quarter turn (see ``_augment``).

    ``device`` defaults to CUDA when available, else CPU. On CPU the result is
    deterministic for a seed (and a fixed thread count). The global torch RNG is left as
    it was, so training does not perturb the caller's randomness. The returned model is
    on the CPU and in eval mode, ready for ``evaluate`` and ``export_onnx``.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    x_all = images_to_tensor(images)
    y_all = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    if x_all.shape[0] != y_all.shape[0]:
        raise ValueError(f"{x_all.shape[0]} images but {y_all.shape[0]} labels")
    n_classes = max(2, int(y_all.max().item()) + 1) if y_all.numel() else 2
    target = torch.device(device or default_device())

    model = new_model(seed, n_classes=n_classes)
    shuffle = torch.Generator().manual_seed(seed)

    model.to(target)
    optimizer = torch.optim.Adam(model.parameters(), lr=_LEARNING_RATE)
    loss_fn = nn.CrossEntropyLoss()
    x_dev, y_dev = x_all.to(target), y_all.to(target)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(x_all.shape[0], generator=shuffle).to(target)
        for start in range(0, order.shape[0], _BATCH_SIZE):
            batch = order[start : start + _BATCH_SIZE]
            inputs = _augment(x_dev[batch], shuffle)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), y_dev[batch])
            loss.backward()
            optimizer.step()
    model.to(torch.device("cpu"))
    model.eval()
    return model


def _augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Apply one of the 8 square symmetries to the whole batch.

    Scratch angles and brushing directions are uniform, so the label is invariant under
    flips and 90-degree turns; this multiplies the effective data for free. One draw per
    batch keeps the cost negligible and the stream deterministic.
    """
    choice = int(torch.randint(0, 8, (1,), generator=generator).item())
    quarter_turns, flip = divmod(choice, 2)
    x = torch.rot90(x, quarter_turns, dims=(2, 3))
    return torch.flip(x, dims=(3,)) if flip else x


def predict_proba(model: nn.Module, images: npt.NDArray[np.generic]) -> npt.NDArray[np.float32]:
    """Softmax probabilities ``(n, n_classes)`` from the torch model (eval mode)."""
    model.eval()
    device = next(model.parameters()).device
    x_all = images_to_tensor(images)
    outputs: list[npt.NDArray[np.float32]] = []
    with torch.no_grad():
        for start in range(0, x_all.shape[0], 256):
            logits = model(x_all[start : start + 256].to(device))
            outputs.append(torch.softmax(logits, dim=1).cpu().numpy().astype(np.float32))
    if not outputs:
        return np.zeros((0, 0), dtype=np.float32)
    return np.concatenate(outputs, axis=0)


def evaluate(
    model: nn.Module, images: npt.NDArray[np.generic], labels: npt.NDArray[np.integer]
) -> float:
    """Accuracy of ``model`` on ``images`` against ``labels`` (leaves it in eval mode)."""
    if len(labels) == 0:
        raise ValueError("cannot evaluate on an empty set")
    predicted = predict_proba(model, images).argmax(axis=1)
    return float(np.mean(predicted == np.asarray(labels)))


def export_onnx(
    model: nn.Module,
    path: Path,
    *,
    image_size: int = IMAGE_SIZE,
    verify_images: npt.NDArray[np.floating] | None = None,
) -> float:
    """Export ``model`` to ONNX at ``path`` with a softmax output, verify it, return max |diff|.

    The graph takes ``image`` float32 ``[batch, 1, image_size, image_size]`` (32 unless
    told otherwise; ``InspectionNet`` itself is size-agnostic) and returns ``probs``
    ``[batch, n_classes]``. After writing, the file is run with onnxruntime on the CPU
    and compared with torch on a few random probes plus, when given, ``verify_images``
    (float ``[n, 1, image_size, image_size]`` in [0, 1], e.g. a student's proxy set); a
    difference above 1e-4 raises ``ModelExportError`` (the file is left in place for
    inspection). Returns the largest difference seen.
    """
    # A CPU copy keeps the caller's model where it was (device, train/eval mode).
    wrapped = _ProbabilityHead(copy.deepcopy(model).cpu()).eval()
    write_onnx(wrapped, path, image_size, (OUTPUT_NAME,), ModelExportError)
    return _verify_onnx(wrapped, path, image_size, verify_images)


def write_onnx(
    module: nn.Module,
    path: Path,
    image_size: int,
    outputs: tuple[str, ...],
    error: type[Exception],
) -> None:
    """Export ``module`` (``image`` ``[batch, 1, size, size]`` in, ``outputs`` out, the
    batch dynamic) to ``path``; any failure of the exporter is raised as ``error``."""
    dummy = torch.zeros(1, 1, image_size, image_size, dtype=torch.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # The TorchScript exporter (dynamo=False) is chosen on purpose: it needs no
        # onnxscript and gives a plain opset-17 graph. Its deprecation notice is noise.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                module,
                (dummy,),
                str(path),
                dynamo=False,
                opset_version=OPSET_VERSION,
                input_names=[INPUT_NAME],
                output_names=list(outputs),
                dynamic_axes={INPUT_NAME: {0: "batch"}, **{name: {0: "batch"} for name in outputs}},
            )
    except Exception as exc:  # the exporter raises many unrelated types
        raise error(f"torch.onnx.export failed for {path}: {exc}") from exc


def _verify_onnx(
    wrapped: nn.Module,
    path: Path,
    image_size: int,
    verify_images: npt.NDArray[np.floating] | None,
) -> float:
    """Run the exported file with onnxruntime and compare with torch; the max |diff|."""
    import onnxruntime as ort  # local: only needed for this check

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelExportError(f"onnxruntime cannot load exported model {path}: {exc}") from exc

    rng = np.random.default_rng(0)
    # Batch sizes 1 and 3 exercise the dynamic batch axis; random pixels plus a
    # constant image cover both busy and flat inputs.
    probes = [
        rng.random((1, 1, image_size, image_size), dtype=np.float32),
        rng.random((3, 1, image_size, image_size), dtype=np.float32),
        np.full((1, 1, image_size, image_size), 0.5, dtype=np.float32),
    ]
    if verify_images is not None:
        expected_shape = (1, image_size, image_size)
        if verify_images.ndim != 4 or tuple(verify_images.shape[1:]) != expected_shape:
            raise ValueError(
                f"verify_images must be [n, 1, {image_size}, {image_size}], "
                f"got {verify_images.shape}"
            )
        verify = np.ascontiguousarray(verify_images, dtype=np.float32)
        # Chunks of 256 keep ORT's and torch's activations small on a large proxy set.
        probes += [verify[start : start + 256] for start in range(0, len(verify), 256)]
    worst = 0.0
    for probe in probes:
        with torch.no_grad():
            expected = wrapped(torch.from_numpy(probe)).numpy()
        try:
            (actual,) = session.run([OUTPUT_NAME], {INPUT_NAME: probe})
        except Exception as exc:
            raise ModelExportError(f"onnxruntime failed to run {path}: {exc}") from exc
        if actual.shape != expected.shape:
            raise ModelExportError(
                f"exported model {path} returned shape {actual.shape}, torch {expected.shape}"
            )
        diff = float(np.max(np.abs(actual - expected)))
        if diff > _VERIFY_TOLERANCE:
            raise ModelExportError(
                f"exported model {path} disagrees with torch: max |diff| = {diff:.3g} "
                f"> {_VERIFY_TOLERANCE:g} on a batch of {probe.shape[0]}"
            )
        worst = max(worst, diff)
    return worst

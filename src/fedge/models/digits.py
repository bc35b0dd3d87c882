"""Small torch models for 8x8 digits, and their evaluation on a test set.

The models take the flattened image (float32 ``[batch, 64]`` in [0, 1], as
``fedge.datasets.tables.load_dataset`` returns it) and output logits over 10 classes. Three
sizes exist to distil between (FedDF, Lin et al. 2020), and mlp-large at half width to
nest in it (HeteroFL, Diao et al. 2021); register more in :data:`ARCHITECTURES`.

Parties train them with the trainer every party shares, stations included
(:mod:`fedge.party.trainer`, issue 32); :func:`evaluate` and :func:`accuracy` are the
server's and the simulator's test-set measurements.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch
from flwr.app import ArrayRecord
from torch import nn

from fedge.models.errors import ModelsError

N_FEATURES = 64
N_CLASSES = 10


class ModelError(ModelsError):
    """An unknown architecture, or arrays that do not fit the model."""


def _mlp(*widths: int) -> nn.Module:
    layers: list[nn.Module] = []
    for index, (width_in, width_out) in enumerate(itertools.pairwise(widths)):
        if index:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(width_in, width_out))
    return nn.Sequential(*layers)


ARCHITECTURES: dict[str, Callable[[], nn.Module]] = {
    "mlp": lambda: _mlp(N_FEATURES, 64, N_CLASSES),
    "mlp-large": lambda: _mlp(N_FEATURES, 256, 128, N_CLASSES),
    "mlp-small": lambda: _mlp(N_FEATURES, 16, N_CLASSES),
    # mlp-large at half its width: the first 128 and 64 of its hidden units, so a slice of
    # it (HeteroFL's nested sub-model, fedge.aggregator.strategies.nested); 2.95x fewer
    # parameters.
    "mlp-large-half": lambda: _mlp(N_FEATURES, 128, 64, N_CLASSES),
}
"""Architecture name -> builder of a fresh, randomly initialised model (add your own)."""

# Seeding the global torch RNG is process-wide: parties trained on a thread pool must not
# interleave their seed-and-build steps.
_INIT_LOCK = threading.Lock()


def default_device() -> str:
    """The device to train on, decided at run time rather than at import."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_model(arch: str = "mlp", seed: int = 0) -> nn.Module:
    """A freshly initialised ``arch`` model; the same seed gives the same weights."""
    try:
        builder = ARCHITECTURES[arch]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ModelError(f"unknown architecture {arch!r} (known: {known})") from None
    # fork_rng keeps the caller's global torch RNG untouched.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder()


def to_arrays(model: nn.Module) -> ArrayRecord:
    """The model's ``state_dict`` as a Flower ArrayRecord."""
    return ArrayRecord(model.state_dict())


def load_arrays(model: nn.Module, arrays: ArrayRecord) -> None:
    """Load arrays into ``model``; raises :class:`ModelError` when they do not fit it."""
    try:
        model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    except (RuntimeError, KeyError) as exc:
        raise ModelError(f"the received arrays do not fit this model: {exc}") from exc


def count_parameters(model: nn.Module) -> int:
    """Trainable scalars in the model."""
    return sum(parameter.numel() for parameter in model.parameters())


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's ``state_dict`` tensors: what one transfer of it costs."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@torch.no_grad()
def evaluate(
    model: nn.Module,
    X: npt.NDArray[np.float32],
    y: npt.NDArray[np.int64],
    device: str | None = None,
) -> tuple[float, float]:
    """``(mean cross-entropy, accuracy)`` of ``model`` on ``(X, y)``; ``(0, 0)`` when empty."""
    if len(X) == 0:
        return 0.0, 0.0
    target = torch.device(device or default_device())
    model.to(target)
    model.eval()
    logits = model(torch.tensor(X, dtype=torch.float32, device=target))
    labels = torch.tensor(y, dtype=torch.int64, device=target)
    loss = float(nn.functional.cross_entropy(logits, labels))
    accuracy = float((logits.argmax(dim=1) == labels).float().mean())
    return loss, accuracy


def accuracy(
    model: nn.Module,
    X: npt.NDArray[np.float32],
    y: npt.NDArray[np.int64],
    device: str | None = None,
) -> float:
    """Fraction of ``(X, y)`` the model classifies correctly (0 when empty)."""
    return evaluate(model, X, y, device)[1]

"""Local training and evaluation on a station's labelled images (torch).

The station's ClientApp (:mod:`fedge.party.station_app`) calls these with the images its
agent kept (:mod:`fedge.party.station_store`) prepared as the model's manifest says
(:mod:`fedge.party.preprocess`). Unreadable files and labels the model has no class for
are skipped and counted, never fatal; a station left with nothing to train on is.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedge.party.errors import StationDataError
from fedge.party.preprocess import ImageError, prepare
from fedge.party.station_store import LabelledImage
from fedge.protocols.manifest import Preprocess


@dataclass(frozen=True)
class TrainSettings:
    """One round of local training (the round config over the station's limits)."""

    lr: float = 3e-3
    epochs: int = 2
    batch_size: int = 32
    max_seconds: float = 600.0
    threads: int = 1
    seed: int = 0
    augment_symmetries: bool = False


@dataclass(frozen=True)
class Examples:
    """Prepared images and class indices, with what had to be left out and why."""

    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]
    skipped: Counter[str] = field(default_factory=Counter)

    def __len__(self) -> int:
        return int(self.y.shape[0])


def load_examples(
    items: Sequence[LabelledImage], classes: Sequence[str], spec: Preprocess
) -> Examples:
    """Prepare every item whose file reads and whose label is one of ``classes``."""
    index = {name: i for i, name in enumerate(classes)}
    xs: list[npt.NDArray[np.float32]] = []
    ys: list[int] = []
    skipped: Counter[str] = Counter()
    for item in items:
        if item.label not in index:
            skipped["unknown_label"] += 1
            continue
        try:
            xs.append(prepare(item.path, spec))
        except (ImageError, FileNotFoundError):
            skipped["unreadable_image"] += 1
            continue
        ys.append(index[item.label])
    shape = (0, spec.channels, spec.image_size, spec.image_size)
    x = np.stack(xs) if xs else np.empty(shape, np.float32)
    return Examples(x, np.asarray(ys, dtype=np.int64), skipped)


def split(items: Sequence[LabelledImage]) -> tuple[list[LabelledImage], list[LabelledImage]]:
    """(training items, held-out items)."""
    train = [i for i in items if not i.holdout]
    held_out = [i for i in items if i.holdout]
    return train, held_out


def device() -> torch.device:
    """CUDA when this station has it, else the CPU (decided at run time)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class TrainResult:
    loss: float
    seconds: float
    steps: int
    stopped_early: bool  # the round's time cap ended training


def train(
    model: nn.Module,
    examples: Examples,
    settings: TrainSettings,
    *,
    on: torch.device | None = None,
) -> TrainResult:
    """Adam on shuffled mini-batches for ``epochs``, stopping at ``max_seconds``; on
    ``on`` (default: CUDA when present, else the CPU)."""
    if len(examples) == 0:
        raise StationDataError("no labelled training images on this station")
    torch.set_num_threads(settings.threads)
    target = on or device()
    generator = torch.Generator().manual_seed(settings.seed)
    x_all = torch.from_numpy(examples.x).to(target)
    y_all = torch.from_numpy(examples.y).to(target)
    model.to(target)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    loss_fn = nn.CrossEntropyLoss()
    started = time.perf_counter()
    losses: list[float] = []
    stopped = False
    for _ in range(settings.epochs):
        order = torch.randperm(len(examples), generator=generator).to(target)
        for start in range(0, len(examples), settings.batch_size):
            batch = order[start : start + settings.batch_size]
            inputs = x_all[batch]
            if settings.augment_symmetries:
                inputs = _symmetry(inputs, generator)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), y_all[batch])
            loss.backward()
            optimizer.step()
            losses.append(float(loss.item()))
            if time.perf_counter() - started >= settings.max_seconds:
                stopped = True
                break
        if stopped:
            break
    model.to(torch.device("cpu"))
    model.eval()
    return TrainResult(
        loss=float(np.mean(losses)) if losses else float("nan"),
        seconds=time.perf_counter() - started,
        steps=len(losses),
        stopped_early=stopped,
    )


def accuracy(model: nn.Module, examples: Examples) -> float:
    """Share of ``examples`` the model classifies right (NaN for none)."""
    if len(examples) == 0:
        return float("nan")
    model.eval()
    target = next(model.parameters()).device
    correct = 0
    with torch.no_grad():
        for start in range(0, len(examples), 256):
            x = torch.from_numpy(examples.x[start : start + 256]).to(target)
            predicted = model(x).argmax(dim=1).cpu().numpy()
            correct += int(np.sum(predicted == examples.y[start : start + 256]))
    return correct / len(examples)


def _symmetry(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One of the 8 square symmetries for the whole batch (label-preserving on surfaces)."""
    choice = int(torch.randint(0, 8, (1,), generator=generator).item())
    quarter_turns, flip = divmod(choice, 2)
    x = torch.rot90(x, quarter_turns, dims=(2, 3))
    return torch.flip(x, dims=(3,)) if flip else x

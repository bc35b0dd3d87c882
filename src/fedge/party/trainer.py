"""The one local trainer every party runs (torch): stations and simulated parties alike.

A station (:mod:`fedge.party.station_app`) feeds it the images its agent kept
(:mod:`fedge.party.station_store`) prepared as the model's manifest says
(:mod:`fedge.party.preprocess`); a simulated party (:mod:`fedge.sim.party_app`) is a
station whose data set is generated: it feeds its partition. Both train, evaluate and
train privately through the functions here (issue 32), so a fix, an optimiser or a DP
change made for one is made for the other:

- :func:`train`: shuffled mini-batches for ``epochs``, Adam (the stations' default) or
  plain SGD (FedAvg's local step, McMahan et al., AISTATS'17: the simulator's scenarios),
  with FedProx's proximal term ``mu/2 * ||w - w_global||^2`` when ``proximal_mu > 0``
  (Li et al., MLSys 2020; ../shared/research/fl-algorithms.md section 6.1), stopping at
  ``max_seconds``;
- :func:`train_private`: the same round as DP-SGD (:mod:`fedge.party.private_round`:
  planned, checked against the party's ledger, trained, recorded);
- :func:`evaluate` / :func:`accuracy`: the model on held-out examples.

Unreadable files and labels the model has no class for are skipped and counted
(:func:`load_examples`), never fatal; a party left with nothing to train on is.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedge.party.errors import PartyError, StationDataError
from fedge.party.preprocess import ImageError, prepare
from fedge.party.station_store import LabelledImage
from fedge.protocols.manifest import Preprocess

if TYPE_CHECKING:
    from fedge.privacy.floor import PrivacyFloor
    from fedge.privacy.settings import PrivacySpec

Optimizer = Literal["adam", "sgd"]
EVAL_BATCH = 256


@dataclass(frozen=True)
class TrainSettings:
    """One round of local training (the round config over the party's limits)."""

    lr: float = 3e-3
    epochs: int = 2
    batch_size: int = 32
    max_seconds: float | None = 600.0  # None: no cap (a simulated party's time is virtual)
    threads: int | None = 1  # torch's CPU threads while training; None: leave them as set
    seed: int = 0  # shuffling (and DP-SGD's sampling and noise: a station's is secret)
    augment_symmetries: bool = False
    optimizer: Optimizer = "adam"
    proximal_mu: float = 0.0  # FedProx's mu; 0: plain local training

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise PartyError(
                f"training needs epochs >= 1 and batch_size >= 1, got {self.epochs}, "
                f"{self.batch_size}"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise PartyError(f"training needs a learning rate > 0, got {self.lr}")
        if not (math.isfinite(self.proximal_mu) and self.proximal_mu >= 0):
            raise PartyError(f"proximal_mu must be >= 0, got {self.proximal_mu}")
        if self.optimizer not in ("adam", "sgd"):
            raise PartyError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise PartyError(f"max_seconds must be > 0 (or None), got {self.max_seconds}")
        if self.threads is not None and self.threads < 1:
            raise PartyError(f"threads must be >= 1 (or None), got {self.threads}")


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
    loss: float  # mean cross-entropy over every example seen (no proximal term)
    seconds: float
    steps: int
    stopped_early: bool  # the round's time cap ended training
    dp_metrics: Mapping[str, int | float] = field(default_factory=dict)
    """DP-SGD's release and epsilon spent (:meth:`PrivateRound.metrics`); empty without."""


def train(
    model: nn.Module,
    examples: Examples,
    settings: TrainSettings,
    *,
    on: torch.device | None = None,
    anchor: Sequence[torch.Tensor] | None = None,
) -> TrainResult:
    """Train ``model`` in place on ``examples``; on ``on`` (default: CUDA when present,
    else the CPU), left on the CPU in eval mode.

    Batches are shuffled with ``settings.seed``, so a seed reproduces a round. With
    ``proximal_mu > 0`` the objective gains FedProx's term towards ``anchor`` (the global
    model's parameters in ``model.parameters()`` order; default: the model as received).
    """
    if len(examples) == 0:
        raise StationDataError("no labelled training examples to train on")
    with _threads(settings.threads):
        return _train(model, examples, settings, on or device(), anchor)


def _train(
    model: nn.Module,
    examples: Examples,
    settings: TrainSettings,
    target: torch.device,
    anchor: Sequence[torch.Tensor] | None,
) -> TrainResult:
    generator = torch.Generator().manual_seed(settings.seed)
    # Copies: the caller's arrays may be read-only (the simulator caches its partitions).
    x_all = torch.tensor(examples.x, dtype=torch.float32, device=target)
    y_all = torch.tensor(examples.y, dtype=torch.int64, device=target)
    model.to(target)
    model.train()
    anchors = _anchors(model, anchor, target) if settings.proximal_mu > 0 else []
    optimizer: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=settings.lr)
        if settings.optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=settings.lr)
    )
    loss_fn = nn.CrossEntropyLoss()
    started = time.perf_counter()
    total_loss, seen, steps, stopped = 0.0, 0, 0, False
    for _ in range(settings.epochs):
        order = torch.randperm(len(examples), generator=generator).to(target)
        for start in range(0, len(examples), settings.batch_size):
            batch = order[start : start + settings.batch_size]
            inputs = x_all[batch]
            if settings.augment_symmetries:
                inputs = _symmetry(inputs, generator)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), y_all[batch])
            objective = loss
            if anchors:
                drift = sum(
                    (torch.sum((p - a) ** 2) for p, a in zip(model.parameters(), anchors,
                                                              strict=True)),
                    torch.zeros((), device=target),
                )  # fmt: skip
                objective = loss + settings.proximal_mu / 2 * drift
            objective.backward()
            optimizer.step()
            total_loss += float(loss.detach()) * len(batch)
            seen += len(batch)
            steps += 1
            if (
                settings.max_seconds is not None
                and time.perf_counter() - started >= settings.max_seconds
            ):
                stopped = True
                break
        if stopped:
            break
    model.to(torch.device("cpu"))
    model.eval()
    return TrainResult(
        loss=total_loss / seen if seen else float("nan"),
        seconds=time.perf_counter() - started,
        steps=steps,
        stopped_early=stopped,
    )


def train_private(
    model: nn.Module,
    examples: Examples,
    settings: TrainSettings,
    privacy: PrivacySpec,
    *,
    ledger_path: Path,
    job: str,
    server_round: int,
    floor: PrivacyFloor | None = None,
) -> TrainResult:
    """One DP-SGD round of ``settings`` (:func:`fedge.party.private_round.train_round`:
    planned, checked against the ledger at ``ledger_path``, trained, recorded).

    The optimiser is the settings' (DP-Adam: the noisy clipped gradient is Adam's input;
    privacy is the gradient's, the optimiser post-processing). No symmetry augmentation
    (DP-SGD clips each example's gradient as sampled) and no proximal term (its gradient
    is not clipped per example). ``settings.seed`` drives sampling and noise: a station
    passes a secret one, never one the server sent.
    """
    if settings.proximal_mu > 0:
        raise PartyError("DP-SGD cannot train with FedProx's proximal term: set proximal-mu 0")
    if len(examples) == 0:
        raise StationDataError("no labelled training examples to train on")
    # Imported here: Opacus takes seconds to load, and rounds without DP-SGD never need it.
    from fedge.party import private_round

    done = private_round.train_round(
        model,
        examples.x,
        examples.y,
        spec=privacy,
        ledger_path=ledger_path,
        job=job,
        server_round=server_round,
        epochs=settings.epochs,
        lr=settings.lr,
        batch_size=settings.batch_size,
        seed=settings.seed,
        optimizer=settings.optimizer,
        max_seconds=settings.max_seconds,
        threads=settings.threads,
        floor=floor,
    )
    planned_steps = settings.epochs * math.ceil(len(examples) / settings.batch_size)
    steps = done.release.steps
    return TrainResult(done.loss, done.seconds, steps, steps < planned_steps, done.metrics())


def evaluate(model: nn.Module, examples: Examples) -> tuple[float, float]:
    """``(mean cross-entropy, accuracy)`` of ``model`` on ``examples``, on the model's
    device (NaN, NaN for none)."""
    if len(examples) == 0:
        return float("nan"), float("nan")
    model.eval()
    target = next(model.parameters()).device
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(examples), EVAL_BATCH):
            x = torch.tensor(examples.x[start : start + EVAL_BATCH], device=target)
            y = torch.tensor(examples.y[start : start + EVAL_BATCH], device=target)
            logits = model(x)
            loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
    return loss_sum / len(examples), correct / len(examples)


def accuracy(model: nn.Module, examples: Examples) -> float:
    """Share of ``examples`` the model classifies right (NaN for none)."""
    return evaluate(model, examples)[1]


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    """torch's thread count is the process's: set for this training, then put back."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(previous)


def _anchors(
    model: nn.Module, anchor: Sequence[torch.Tensor] | None, target: torch.device
) -> list[torch.Tensor]:
    parameters = list(model.parameters())
    source = anchor if anchor is not None else parameters
    anchors = [p.detach().to(target).clone() for p in source]
    if len(anchors) != len(parameters):
        raise PartyError(
            f"the proximal anchor has {len(anchors)} tensors, the model has "
            f"{len(parameters)} parameters"
        )
    return anchors


def _symmetry(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One of the 8 square symmetries for the whole batch (label-preserving on surfaces)."""
    choice = int(torch.randint(0, 8, (1,), generator=generator).item())
    quarter_turns, flip = divmod(choice, 2)
    x = torch.rot90(x, quarter_turns, dims=(2, 3))
    return torch.flip(x, dims=(3,)) if flip else x

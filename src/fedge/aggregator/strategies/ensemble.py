"""Server-side ensemble distillation (FedDF, Lin et al., NeurIPS 2020) across architectures.

The teacher is the ensemble of the current models: the AVERAGE of their logits on an
unlabeled proxy set. Each architecture's model is trained to match it with Hinton's
soft-target loss, Adam as in FedDF's official code (../shared/research/fl-algorithms.md
section 5.1). Labels are never used: the proxy set is features only. The loss, the
ensemble average and the training loop are :mod:`fedge.models.distill`'s (the edge
students use the same); this module adds what a round needs: one call that distils the
ensemble into every architecture and reports the divergence before and after.

Everything here is a function of its arguments (and a seed): no strategy state.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from flwr.app import ArrayRecord
from torch import nn

from fedge.models import digits
from fedge.models.architectures import DIGITS, Architectures
from fedge.models.distill import ProxyError, check_proxy, distillation_loss, teacher_logits
from fedge.models.distill import distill as train_student


@dataclass(frozen=True)
class DistillSettings:
    """How each round distils the ensemble into every architecture.

    ``validation_fraction`` > 0 holds that share of the proxy set out of training and
    keeps, per architecture, the epoch whose divergence from the ensemble on it is lowest
    (epoch 0, the within-architecture average, included), stopping after ``patience``
    epochs without a new best: FedDF's early stopping on a validation split (Lin et al.,
    NeurIPS 2020, section 4: Adam 1e-3, early stopping on held-out data). Ours is label-free
    (the held-out samples are proxy features, scored against the ensemble's logits), so
    the server still reads no labels. ``epochs`` is then the most epochs a round may take.
    """

    temperature: float = 1.0
    epochs: int = 5
    lr: float = 1e-3
    batch_size: int = 32
    validation_fraction: float = 0.0
    patience: int = 5

    def __post_init__(self) -> None:
        if not (np.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.epochs < 0:
            raise ValueError(f"distill_epochs must be >= 0, got {self.epochs}")
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"distill_lr must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"distill_batch_size must be >= 1, got {self.batch_size}")
        if not (np.isfinite(self.validation_fraction) and 0 <= self.validation_fraction < 1):
            raise ValueError(
                f"distill_validation must be in [0, 1), got {self.validation_fraction}"
            )
        if self.patience < 1:
            raise ValueError(f"distill_patience must be >= 1, got {self.patience}")


@dataclass(frozen=True)
class ProxySplit:
    """Which proxy samples distillation trains on and which it early-stops on."""

    train: npt.NDArray[np.int64]
    validation: npt.NDArray[np.int64]


def split_proxy(n: int, fraction: float, seed: int) -> ProxySplit:
    """A seeded split of ``n`` proxy samples: ``round(fraction * n)`` held out (at least
    one when ``fraction`` > 0, and at least one left to train on). Made once per job, so
    every round early-stops on the same samples. ``ValueError`` if ``n`` < 2 with a
    fraction > 0: nothing could be both trained on and held out."""
    order = np.random.default_rng(seed).permutation(n).astype(np.int64)
    if fraction <= 0:
        return ProxySplit(train=np.sort(order), validation=np.empty(0, dtype=np.int64))
    if n < 2:
        raise ValueError(
            f"distill_validation needs at least 2 proxy samples to hold some out, got {n}; "
            "enlarge the proxy set or set distill_validation = 0"
        )
    held = min(n - 1, max(1, round(fraction * n)))
    return ProxySplit(train=np.sort(order[held:]), validation=np.sort(order[:held]))


def validate_proxy(
    proxy_X: object, sample_shape: tuple[int, ...] = DIGITS.sample_shape
) -> npt.NDArray[np.float32]:
    """The proxy set as a float32 ``[n, *sample_shape]`` copy; :class:`ProxyError` naming
    the flaw."""
    check_proxy(proxy_X, sample_shape)
    assert isinstance(proxy_X, np.ndarray)
    return np.array(proxy_X, dtype=np.float32, order="C", copy=True)  # writable, ours


@torch.no_grad()
def divergence(
    student: nn.Module, teacher: torch.Tensor, X: torch.Tensor, temperature: float
) -> float:
    """The loss distillation minimises (``teacher``: the target logits), on all of ``X``."""
    student.eval()
    return float(distillation_loss(student(X), teacher, temperature))


def distill_into_each(
    models: Mapping[str, ArrayRecord],
    proxy_X: npt.NDArray[np.float32],
    settings: DistillSettings,
    *,
    teachers: Iterable[str] | None = None,
    seed: int = 0,
    architectures: Architectures = DIGITS,
    split: ProxySplit | None = None,
) -> tuple[dict[str, ArrayRecord], dict[str, tuple[float, float]]]:
    """Distil the ensemble of ``teachers`` (default: all) into every architecture.

    ``models`` maps an architecture name (one of ``architectures``, by default the digits
    MLPs) to its weights. Returns the distilled weights and, per architecture, the loss
    before and after: on the held-out samples when ``split`` holds some out (then each
    architecture keeps its best epoch on them, :class:`DistillSettings`), else on all.
    """
    names = list(models)
    wanted = set(names if teachers is None else teachers)
    if not wanted & set(names):
        raise ValueError("no teacher among the models")
    X = torch.tensor(proxy_X, dtype=torch.float32)
    built = {
        name: _built(architectures, name, models[name], seed + i) for i, name in enumerate(names)
    }
    # The teacher is the ensemble BEFORE this round's distillation: frozen copies, so
    # distilling one architecture does not move the target of the next.
    members = [copy.deepcopy(built[name]) for name in names if name in wanted]
    target = teacher_logits(members, X)
    out: dict[str, ArrayRecord] = {}
    losses: dict[str, tuple[float, float]] = {}
    if split is not None and split.validation.size:
        return _distill_early_stopped(built, target, X, split, settings, seed)
    for index, name in enumerate(names):
        student = built[name]
        before = divergence(student, target, X, settings.temperature)
        if settings.epochs:
            train_student(
                members,  # frozen while it runs: it averages copies made before any training
                student,
                proxy_X,
                epochs=settings.epochs,
                lr=settings.lr,
                batch_size=settings.batch_size,
                temperature=settings.temperature,
                seed=seed * 31 + index,
                input_shape=architectures.sample_shape,
            )
        losses[name] = (before, divergence(student, target, X, settings.temperature))
        out[name] = digits.to_arrays(student)
    return out, losses


def _distill_early_stopped(
    built: Mapping[str, nn.Module],
    target: torch.Tensor,
    X: torch.Tensor,
    split: ProxySplit,
    settings: DistillSettings,
    seed: int,
) -> tuple[dict[str, ArrayRecord], dict[str, tuple[float, float]]]:
    """FedDF's loop with early stopping: Adam on the training samples, the divergence on
    the held-out ones after every epoch, the best epoch's weights kept (epoch 0 too: a
    round whose distillation does not generalise leaves the within-architecture average)."""
    train = torch.from_numpy(split.train)
    held = torch.from_numpy(split.validation)
    X_train, target_train = X[train], target[train]
    X_held, target_held = X[held], target[held]
    out: dict[str, ArrayRecord] = {}
    losses: dict[str, tuple[float, float]] = {}
    for index, (name, student) in enumerate(built.items()):
        before = best = divergence(student, target_held, X_held, settings.temperature)
        best_state = copy.deepcopy(student.state_dict())
        best_epoch = 0
        optimizer = torch.optim.Adam(student.parameters(), lr=settings.lr)
        generator = torch.Generator().manual_seed(seed * 31 + index)
        for epoch in range(1, settings.epochs + 1):
            student.train()
            order = torch.randperm(X_train.shape[0], generator=generator)
            for start in range(0, X_train.shape[0], settings.batch_size):
                batch = order[start : start + settings.batch_size]
                optimizer.zero_grad()
                loss = distillation_loss(
                    student(X_train[batch]), target_train[batch], settings.temperature
                )
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
            now = divergence(student, target_held, X_held, settings.temperature)
            if now < best:
                best, best_state, best_epoch = now, copy.deepcopy(student.state_dict()), epoch
            elif epoch - best_epoch >= settings.patience:
                break
        student.load_state_dict(best_state)
        student.eval()
        losses[name] = (before, best)
        out[name] = digits.to_arrays(student)
    return out, losses


def _built(architectures: Architectures, arch: str, arrays: ArrayRecord, seed: int) -> nn.Module:
    model = architectures.build(arch, seed)
    digits.load_arrays(model, arrays)
    return model.to("cpu")


__all__ = [
    "DistillSettings",
    "ProxyError",
    "ProxySplit",
    "distill_into_each",
    "divergence",
    "split_proxy",
    "validate_proxy",
]

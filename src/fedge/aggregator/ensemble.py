"""Server-side ensemble distillation (FedDF, Lin et al., NeurIPS 2020).

The teacher is the ensemble of the current models: the AVERAGE of their logits on an
unlabeled proxy set. Each student is trained to match it with Hinton's soft-target loss
``KL(softmax(t / T) || softmax(s / T)) * T**2`` (Hinton et al. 2015), with Adam as in
FedDF's official code (../shared/research/fl-algorithms.md section 5.1). Labels are never
used: the proxy set is features only.

Everything here is a function of its arguments (and a seed): no strategy state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from flwr.app import ArrayRecord
from torch import nn

from fedge.errors import FedgeError
from fedge.models import digits


class ProxyDataError(FedgeError, ValueError):
    """The server's unlabeled proxy set cannot be used for distillation."""


@dataclass(frozen=True)
class DistillSettings:
    temperature: float = 1.0
    epochs: int = 5
    lr: float = 1e-3
    batch_size: int = 32

    def __post_init__(self) -> None:
        if not (np.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.epochs < 0:
            raise ValueError(f"distill_epochs must be >= 0, got {self.epochs}")
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"distill_lr must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"distill_batch_size must be >= 1, got {self.batch_size}")


def validate_proxy(proxy_X: object, n_features: int = digits.N_FEATURES) -> npt.NDArray[np.float32]:
    """The proxy set as float32 ``[n, n_features]``; :class:`ProxyDataError` naming the flaw."""
    if not isinstance(proxy_X, np.ndarray):
        raise ProxyDataError(f"proxy_X must be a numpy array, got {type(proxy_X).__name__}")
    if proxy_X.ndim != 2 or proxy_X.shape[1] != n_features:
        raise ProxyDataError(
            f"proxy_X must have shape [n, {n_features}], got {list(proxy_X.shape)}"
        )
    if proxy_X.shape[0] == 0:
        raise ProxyDataError("proxy_X is empty: distillation needs at least one example")
    if not np.issubdtype(proxy_X.dtype, np.floating):
        raise ProxyDataError(f"proxy_X must hold floats, got dtype {proxy_X.dtype}")
    if not np.all(np.isfinite(proxy_X)):
        raise ProxyDataError("proxy_X holds NaN or infinite values")
    return np.array(proxy_X, dtype=np.float32, order="C", copy=True)  # writable, ours


def kd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Hinton's loss ``KL(softmax(t/T) || softmax(s/T)) * T**2``, averaged over the batch."""
    teacher = nn.functional.log_softmax(teacher_logits / temperature, dim=1)
    student = nn.functional.log_softmax(student_logits / temperature, dim=1)
    kl = nn.functional.kl_div(student, teacher, reduction="batchmean", log_target=True)
    return kl * temperature**2


@torch.no_grad()
def ensemble_logits(models: Sequence[nn.Module], X: torch.Tensor) -> torch.Tensor:
    """The teacher: the mean of the models' logits on ``X``."""
    if not models:
        raise ValueError("the ensemble needs at least one model")
    total = torch.zeros((), dtype=torch.float32)
    for model in models:
        model.eval()
        total = total + model(X)
    return total / len(models)


@torch.no_grad()
def divergence(
    student: nn.Module, teacher_logits: torch.Tensor, X: torch.Tensor, temperature: float
) -> float:
    """The loss :func:`distill` minimises, on all of ``X``."""
    student.eval()
    return float(kd_loss(student(X), teacher_logits, temperature))


def distill(
    student: nn.Module,
    teacher_logits: torch.Tensor,
    X: torch.Tensor,
    settings: DistillSettings,
    *,
    seed: int = 0,
) -> tuple[float, float]:
    """Train ``student`` in place towards ``teacher_logits``; ``(loss before, loss after)``."""
    before = divergence(student, teacher_logits, X, settings.temperature)
    if settings.epochs == 0:
        return before, before
    optimizer = torch.optim.Adam(student.parameters(), lr=settings.lr)
    generator = torch.Generator().manual_seed(seed)
    student.train()
    for _ in range(settings.epochs):
        order = torch.randperm(len(X), generator=generator)
        for start in range(0, len(X), settings.batch_size):
            batch = order[start : start + settings.batch_size]
            optimizer.zero_grad()
            loss = kd_loss(student(X[batch]), teacher_logits[batch], settings.temperature)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    return before, divergence(student, teacher_logits, X, settings.temperature)


def distill_into_each(
    models: Mapping[str, ArrayRecord],
    proxy_X: npt.NDArray[np.float32],
    settings: DistillSettings,
    *,
    teachers: Iterable[str] | None = None,
    seed: int = 0,
) -> tuple[dict[str, ArrayRecord], dict[str, tuple[float, float]]]:
    """Distil the ensemble of ``teachers`` (default: all) into every architecture.

    ``models`` maps an architecture name (:data:`fedge.models.digits.ARCHITECTURES`) to its
    weights. Returns the distilled weights and, per architecture, the loss before and after.
    """
    names = list(models)
    teacher_names = names if teachers is None else [n for n in names if n in set(teachers)]
    if not teacher_names:
        raise ValueError("no teacher among the models")
    X = torch.tensor(proxy_X, dtype=torch.float32)
    built: dict[str, nn.Module] = {}
    for index, name in enumerate(names):
        built[name] = _built(name, models[name], seed + index)
    target = ensemble_logits([built[n] for n in teacher_names], X)
    out: dict[str, ArrayRecord] = {}
    losses: dict[str, tuple[float, float]] = {}
    for index, name in enumerate(names):
        losses[name] = distill(built[name], target, X, settings, seed=seed * 31 + index)
        out[name] = digits.to_arrays(built[name])
    return out, losses


def _built(arch: str, arrays: ArrayRecord, seed: int) -> nn.Module:
    model = digits.make_model(arch, seed=seed)
    digits.load_arrays(model, arrays)
    return model.to("cpu")

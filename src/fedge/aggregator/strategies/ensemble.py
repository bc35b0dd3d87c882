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
) -> tuple[dict[str, ArrayRecord], dict[str, tuple[float, float]]]:
    """Distil the ensemble of ``teachers`` (default: all) into every architecture.

    ``models`` maps an architecture name (one of ``architectures``, by default the digits
    MLPs) to its weights. Returns the distilled weights and, per architecture, the loss
    before and after.
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


def _built(architectures: Architectures, arch: str, arrays: ArrayRecord, seed: int) -> nn.Module:
    model = architectures.build(arch, seed)
    digits.load_arrays(model, arrays)
    return model.to("cpu")


__all__ = ["DistillSettings", "ProxyError", "distill_into_each", "divergence", "validate_proxy"]

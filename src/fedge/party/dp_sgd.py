"""DP-SGD on a party's examples through Opacus (the adapter; accounting is pure elsewhere).

DP-SGD (Abadi et al., CCS 2016): every step samples a Poisson batch (each example with
probability ``q``), clips every example's gradient to ``clipping_norm``, sums them and
adds Gaussian noise of ``noise_multiplier * clipping_norm`` before the optimiser's step.
Models made of linear and convolution layers (the fleet's MLPs and inspection CNN) get
the clipped sum from one forward and one backward pass (:mod:`fedge.party.clipping`,
book-keeping, Bu et al. 2023) and their noise here, as Opacus' ``DPOptimizer`` adds it;
any other model goes through Opacus' ``GradSampleModule`` (per-example gradients) and
``DPOptimizer`` (clip, sum, noise). Either way the mechanism is the one Opacus'
accountant counts. The Poisson sampling is ours, on tensors in memory, with the rate
Opacus' Poisson loader uses (``1 / ceil(n / batch_size)``). The round's
:class:`~fedge.privacy.settings.DpRelease` is that rate, the noise and the steps taken.

The caller's model is trained in place and handed back clean: every hook (ours or
Opacus', which shares the model's parameters) and per-sample attribute is removed before
returning, so the same model object can be evaluated, exported, or trained again
(privately or not).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.validators import ModuleValidator
from torch import nn

from fedge.party import clipping
from fedge.privacy.settings import DpRelease, PrivacyError

Optimizer = Literal["sgd", "adam"]

# Two warnings every step would log, silenced for good (a per-call ``catch_warnings`` is not
# thread-safe, and simulated parties train on threads). Opacus' "Secure RNG turned off":
# the noise comes from a seeded generator on purpose (see ``train_private``). Torch's
# "Full backward hook is firing ... no inputs require gradients": the first layer's input
# is data, and Opacus' hook is right to fire there.
warnings.filterwarnings("ignore", message="Secure RNG turned off", category=UserWarning)
warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
_PARAM_ATTRS = ("grad_sample", "_forward_counter", "_current_grad_sample", "_norm_sample")
_PARAM_ATTRS_OPTIMIZER = ("summed_grad", "_processed")


@dataclass(frozen=True)
class PrivateTraining:
    """One round of DP-SGD: mean batch loss, optimiser steps, what it released, wall time."""

    loss: float
    steps: int
    release: DpRelease
    seconds: float


def train_private(
    model: nn.Module,
    x: npt.NDArray[np.floating[Any]],
    y: npt.NDArray[np.integer[Any]],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    noise_multiplier: float,
    clipping_norm: float,
    seed: int,
    optimizer: str = "sgd",
    max_seconds: float | None = None,
    threads: int | None = None,
) -> PrivateTraining:
    """Train ``model`` in place with DP-SGD; a ``seed`` reproduces sampling and noise.

    ``max_seconds`` stops training early; the release then counts the steps taken.

    The seed drives the Poisson sampling *and the noise*: whoever knows it can recompute
    the noise and subtract it. A simulation may seed from its scenario; a station must use
    a secret seed of its own (``secrets.randbits(63)``), never one the server sent.
    """
    _validate(x, y, epochs, lr, batch_size, noise_multiplier, clipping_norm, optimizer)
    if max_seconds is not None and not max_seconds > 0:
        raise PrivacyError(f"DP-SGD max_seconds must be > 0, got {max_seconds}")
    if threads is not None and threads < 1:
        raise PrivacyError(f"DP-SGD threads must be >= 1, got {threads}")
    with _torch_threads(threads):
        return _train(model, x, y, epochs, lr, batch_size, noise_multiplier, clipping_norm, seed,
                      optimizer, max_seconds)  # fmt: skip


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's thread count is the process's: set for this training, then put back, so a
    simulator's later rounds without DP are not held to it."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _train(
    model: nn.Module,
    x: npt.NDArray[np.floating[Any]],
    y: npt.NDArray[np.integer[Any]],
    epochs: int,
    lr: float,
    batch_size: int,
    noise_multiplier: float,
    clipping_norm: float,
    seed: int,
    optimizer: str,
    max_seconds: float | None,
) -> PrivateTraining:
    was_training = model.training
    model.train()  # Opacus validates (and trains) a model in training mode
    unsupported = unsupported_layers(model)
    if unsupported:
        model.train(was_training)
        raise PrivacyError(
            "DP-SGD cannot train this model: Opacus has no per-example gradients for "
            f"{'; '.join(unsupported)}. Use a model family without them (e.g. GroupNorm "
            "instead of BatchNorm) for every party of a DP job: the federation needs one "
            "architecture"
        )
    target = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(target)
    # Copies: the caller's arrays may be read-only (the simulator caches its partitions).
    inputs = torch.from_numpy(np.array(x, dtype=np.float32)).to(target)
    labels = torch.from_numpy(np.array(y, dtype=np.int64)).to(target)
    # Opacus' Poisson loader samples each example with probability 1 / (batches per
    # epoch); we sample the same way on tensors already in memory (a DataLoader's
    # per-example indexing and collation cost more than the tiny models' steps).
    batches = math.ceil(len(labels) / batch_size)
    sample_rate = 1.0 / batches
    sampler = torch.Generator(device=target).manual_seed(seed)
    base: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=lr)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=lr)
    )
    expected_batch_size = max(1, int(len(labels) * sample_rate))
    noise = torch.Generator(device=target).manual_seed(seed + 1)
    if clipping.supported(model):
        return _book_kept(
            model,
            base,
            (inputs, labels, sample_rate, sampler),
            (noise_multiplier, clipping_norm, expected_batch_size, noise),
            epochs * batches,
            max_seconds,
        )
    try:
        private_model = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    except (ValueError, NotImplementedError) as exc:
        model.to(torch.device("cpu"))
        raise PrivacyError(f"Opacus cannot make this model private: {exc}") from exc
    private_optimizer = DPOptimizer(
        base,
        noise_multiplier=noise_multiplier,
        max_grad_norm=clipping_norm,
        expected_batch_size=expected_batch_size,
        loss_reduction="mean",
        generator=noise,
    )
    started = time.perf_counter()
    deadline = None if max_seconds is None else started + max_seconds
    try:
        losses, steps = _epochs(
            private_model,
            private_optimizer,
            (inputs, labels, sample_rate, sampler),
            epochs * batches,
            deadline,
        )
    finally:
        _detach(private_model, model)
        model.to(torch.device("cpu"))
        model.eval()
    return PrivateTraining(
        loss=float(np.mean(losses)) if losses else float("nan"),
        steps=steps,
        release=DpRelease(float(noise_multiplier), sample_rate, steps),
        seconds=time.perf_counter() - started,
    )


def _book_kept(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: tuple[torch.Tensor, torch.Tensor, float, torch.Generator],
    mechanism: tuple[float, float, int, torch.Generator],
    steps: int,
    max_seconds: float | None,
) -> PrivateTraining:
    """DP-SGD's steps with :class:`~fedge.party.clipping.BookKeeping`'s clipped sum and
    Opacus' noise and scaling: ``(sum_i clip_C(g_i) + N(0, (sigma C)^2)) / E[batch]``."""
    inputs, labels, sample_rate, sampler = data
    noise_multiplier, clipping_norm, expected_batch_size, noise = mechanism
    parameters = [p for p in model.parameters() if p.requires_grad]
    clipper = clipping.BookKeeping(model)
    losses: list[float] = []
    started = time.perf_counter()
    taken = 0
    try:
        for _ in range(steps):
            chosen = torch.rand(len(labels), generator=sampler, device=labels.device) < sample_rate
            optimizer.zero_grad(set_to_none=True)
            if bool(chosen.any()):
                loss, _ = clipper.clipped_sum(inputs[chosen], labels[chosen], clipping_norm)
                losses.append(loss)
            # an empty Poisson batch still steps: noise only, as Opacus does
            clipping.add_noise(parameters, noise_multiplier * clipping_norm,
                               expected_batch_size, noise)  # fmt: skip
            optimizer.step()
            taken += 1
            if max_seconds is not None and time.perf_counter() - started >= max_seconds:
                break
    finally:
        clipper.close()
        for parameter in model.parameters():
            parameter.grad = None
        model.to(torch.device("cpu"))
        model.eval()  # handed back in eval mode, as the Opacus path does
    return PrivateTraining(
        loss=float(np.mean(losses)) if losses else float("nan"),
        steps=taken,
        release=DpRelease(float(noise_multiplier), sample_rate, taken),
        seconds=time.perf_counter() - started,
    )


def _epochs(
    model: nn.Module,
    optimizer: DPOptimizer,
    data: tuple[torch.Tensor, torch.Tensor, float, torch.Generator],
    steps: int,
    deadline: float | None,
) -> tuple[list[float], int]:
    """(the non-empty batches' losses, the optimiser steps taken) until ``deadline``."""
    inputs, labels, sample_rate, sampler = data
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    for step in range(steps):
        chosen = torch.rand(len(labels), generator=sampler, device=labels.device) < sample_rate
        optimizer.zero_grad(set_to_none=True)
        if bool(chosen.any()):
            loss = loss_fn(model(inputs[chosen]), labels[chosen])
            loss.backward()
            losses.append(float(loss.item()))
        else:  # an empty Poisson batch still steps: noise only, as Opacus does
            for parameter in model.parameters():
                parameter.grad_sample = torch.zeros(  # type: ignore[attr-defined]
                    (0, *parameter.shape), device=parameter.device, dtype=parameter.dtype
                )
        optimizer.step()
        if deadline is not None and time.perf_counter() >= deadline:
            return losses, step + 1
    return losses, steps


def unsupported_layers(model: nn.Module) -> list[str]:
    """``"name (Type): why"`` for every layer Opacus cannot give per-example gradients."""
    if not ModuleValidator.validate(model, strict=False):
        return []
    found: list[str] = []
    for name, module in model.named_modules():
        validator = ModuleValidator.VALIDATORS.get(type(module))
        if validator is None or not any(p.requires_grad for p in module.parameters(False)):
            continue
        for error in validator(module):
            found.append(f"{name or '<model>'} ({type(module).__name__}): {error}")
    return found or [str(e) for e in ModuleValidator.validate(model, strict=False)]


def _validate(
    x: npt.NDArray[np.floating[Any]],
    y: npt.NDArray[np.integer[Any]],
    epochs: int,
    lr: float,
    batch_size: int,
    noise_multiplier: float,
    clipping_norm: float,
    optimizer: str,
) -> None:
    if len(x) == 0:
        raise PrivacyError("no training examples: DP-SGD needs at least one labelled example")
    if len(x) != len(y):
        raise PrivacyError(f"{len(x)} examples but {len(y)} labels: they must pair up")
    if epochs < 1 or batch_size < 1:
        raise PrivacyError(
            f"DP-SGD needs epochs >= 1 and batch_size >= 1, got {epochs}, {batch_size}"
        )
    if not (math.isfinite(lr) and lr > 0):
        raise PrivacyError(f"DP-SGD learning rate must be > 0, got {lr}")
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise PrivacyError(f"DP-SGD noise multiplier must be > 0, got {noise_multiplier}")
    if not (math.isfinite(clipping_norm) and clipping_norm > 0):
        raise PrivacyError(f"DP-SGD clipping norm must be > 0, got {clipping_norm}")
    if optimizer not in ("sgd", "adam"):
        raise PrivacyError(f"DP-SGD optimizer must be sgd or adam, got {optimizer!r}")


def _detach(private_model: nn.Module, model: nn.Module) -> None:
    """Take every Opacus hook and per-sample attribute off the caller's ``model``."""
    if isinstance(private_model, GradSampleModule):
        private_model.to_standard_module()  # removes hooks and grad_sample & co.
    for module in model.modules():
        for attr in ("activations", "max_batch_len"):
            if attr in module.__dict__:
                delattr(module, attr)
    for parameter in model.parameters():
        parameter.grad = None
        for attr in (*_PARAM_ATTRS, *_PARAM_ATTRS_OPTIMIZER):
            if hasattr(parameter, attr):
                delattr(parameter, attr)

"""DP-SGD on a party's examples through Opacus (the adapter; accounting is pure elsewhere).

DP-SGD (Abadi et al., CCS 2016): every step samples a Poisson batch (each example with
probability ``q``), clips every example's gradient to ``clipping_norm``, sums them and
adds Gaussian noise of ``noise_multiplier * clipping_norm`` before the optimiser's step.
Opacus' ``PrivacyEngine`` does exactly that and records each step in its accountant; what
it recorded is the round's :class:`~fedge.party.accounting.DpRelease`.

The caller's model is trained in place and handed back clean: Opacus' ``GradSampleModule``
shares the model's parameters and hooks into its layers, and every hook and per-sample
attribute is removed before returning, so the same model object can be evaluated,
exported, or trained again (privately or not).
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
from opacus import PrivacyEngine
from opacus.grad_sample import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedge.party.accounting import DpRelease
from fedge.party.privacy import PrivacyError

Optimizer = Literal["sgd", "adam"]
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
    if threads is not None:
        if threads < 1:
            raise PrivacyError(f"DP-SGD threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
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
    dataset = TensorDataset(
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64)),
    )
    loader = DataLoader(
        dataset, batch_size=batch_size, generator=torch.Generator().manual_seed(seed)
    )
    base: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=lr)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=lr)
    )
    with _quiet_opacus():
        # The release does not depend on the accountant: every Opacus accountant records
        # the same (sigma, q, steps) history; composing releases is the ledger's job.
        engine = PrivacyEngine(accountant="rdp")
        try:
            private_model, private_optimizer, private_loader = engine.make_private(
                module=model,
                optimizer=base,
                data_loader=loader,
                noise_multiplier=noise_multiplier,
                max_grad_norm=clipping_norm,
                poisson_sampling=True,
                noise_generator=torch.Generator(device=target).manual_seed(seed + 1),
            )
        except (ValueError, NotImplementedError) as exc:
            model.to(torch.device("cpu"))
            raise PrivacyError(f"Opacus cannot make this model private: {exc}") from exc
        started = time.perf_counter()
        deadline = None if max_seconds is None else started + max_seconds
        try:
            losses, steps = _epochs(
                private_model, private_optimizer, private_loader, epochs, target, deadline
            )
        finally:
            _detach(private_model, model)
            model.to(torch.device("cpu"))
            model.eval()
    return PrivateTraining(
        loss=float(np.mean(losses)) if losses else float("nan"),
        steps=steps,
        release=_release(engine, noise_multiplier, steps),
        seconds=time.perf_counter() - started,
    )


def _epochs(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[tuple[torch.Tensor, ...]],
    epochs: int,
    target: torch.device,
    deadline: float | None,
) -> tuple[list[float], int]:
    """(the non-empty batches' losses, the optimiser steps taken) until ``deadline``."""
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    steps = 0
    for _ in range(epochs):
        for inputs, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs.to(target)), labels.to(target))
            loss.backward()
            optimizer.step()
            steps += 1
            if len(labels):  # an empty Poisson batch still steps: noise only
                losses.append(float(loss.item()))
            if deadline is not None and time.perf_counter() >= deadline:
                return losses, steps
    return losses, steps


@contextlib.contextmanager
def _quiet_opacus() -> Iterator[None]:
    """Silence two warnings every round would log. Opacus' "Secure RNG turned off": the
    noise comes from a seeded generator on purpose (see ``train_private``). Torch's "full
    backward hook is firing ... no inputs require gradients": the first layer's input is
    data, Opacus' hook is right to fire there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off", category=UserWarning)
        warnings.filterwarnings(
            "ignore", message="Full backward hook is firing", category=UserWarning
        )
        yield


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


def _release(engine: PrivacyEngine, noise_multiplier: float, steps: int) -> DpRelease:
    """The round's release as Opacus' accountant recorded it (one consistent entry)."""
    history = list(engine.accountant.history)
    if len(history) != 1:
        raise PrivacyError(f"Opacus recorded {len(history)} accountant entries, expected 1")
    sigma, sample_rate, recorded = history[0]
    if recorded != steps or not math.isclose(sigma, noise_multiplier):
        raise PrivacyError(
            f"Opacus accounted {recorded} steps at sigma {sigma}, but {steps} steps at sigma "
            f"{noise_multiplier} were taken: the release would be wrong"
        )
    return DpRelease(float(sigma), float(sample_rate), int(recorded))

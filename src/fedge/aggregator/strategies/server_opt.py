"""Server optimizers (FedOpt): the round's folded mean taken as a pseudo-gradient step.

FedAvg replaces the global model by the round's weighted mean. FedOpt (Reddi et al.,
"Adaptive Federated Optimization", ICLR 2021, Algorithm 2) instead treats the difference
as a *pseudo-gradient* and hands it to a server optimizer, which on non-IID data reaches a
target accuracy in fewer rounds. With ``x`` the global model sent this round and ``mean``
the round's fold (on-time replies plus staleness-weighted late ones, after SecAgg+'s
unmasking or central DP's noise):

    g   = x - mean                                   (pseudo-gradient; -Delta_t in the paper)
    m   = beta1 * m + (1 - beta1) * g                (m_{-1} = 0)
    v   = v + g^2                                     FedAdagrad
    v   = beta2 * v + (1 - beta2) * g^2               FedAdam
    v   = v - (1 - beta2) * g^2 * sign(v - g^2)       FedYogi
    x'  = x - server_lr * m / (sqrt(v) + tau)         (v_{-1} = tau^2, Algorithm 2's input)

and server momentum, FedAvgM (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical
Data Distribution for Federated Visual Classification", 2019):

    m   = beta1 * m + g ;   x' = x - server_lr * m   (server_lr 1, beta1 0: FedAvg)

Algorithm 2 has no bias correction (Flower's ``FedAdam`` adds Adam's); we follow the paper.
Arrays that are not floating point (e.g. BatchNorm's ``num_batches_tracked``) take the
mean as FedAvg does: a step on a counter means nothing.

Everything here is a pure function over frozen dataclasses: :func:`server_step` returns the
new model and a new :class:`ServerOptState`; nothing is modified in place. The state's
moments are whole models; checkpoints keep them as arrays (``StreamingFedAvg``'s
``server_opt_arrays``) so a resumed job continues bit-identically.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

NAMES = ("fedadam", "fedyogi", "fedadagrad", "fedavgm")
ADAPTIVE = ("fedadam", "fedyogi", "fedadagrad")
PARAMS = ("server_opt", "server_lr", "beta1", "beta2", "tau")
"""The strategy-table keys that configure a server optimizer."""
# Flower's FedOpt default server learning rate for the adaptive ones (eta = 0.1); server
# momentum keeps FedAvg's step of 1 (Hsu et al.).
DEFAULT_SERVER_LR = {"fedadam": 0.1, "fedyogi": 0.1, "fedadagrad": 0.1, "fedavgm": 1.0}

Arrays = Mapping[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class ServerOptConfig:
    """Which server optimizer, and its hyper-parameters (validated at construction)."""

    name: str
    server_lr: float
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"server_opt: unknown server optimizer {self.name!r} (known: {NAMES})")
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ValueError(
                f"server_lr must be a number > 0, got {self.server_lr} (the server's step "
                "size on the round's pseudo-gradient)"
            )
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            if not (math.isfinite(value) and 0 <= value < 1):
                raise ValueError(f"{key} must be in [0, 1), got {value}")
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(
                f"tau must be a number > 0, got {self.tau} (it keeps the adaptive step "
                "finite where the second moment is 0)"
            )

    @classmethod
    def from_params(cls, params: Mapping[str, object]) -> ServerOptConfig | None:
        """From a strategy table's ``server_opt``, ``server_lr``, ``beta1``, ``beta2``,
        ``tau`` (types already checked); None when ``server_opt`` is absent.

        A hyper-parameter without ``server_opt``, or one the optimizer does not use
        (``beta2``/``tau`` for ``fedavgm``), is an error rather than silently ignored.
        """
        given = {k: params[k] for k in PARAMS if k in params}
        name = given.pop("server_opt", None)
        if name is None:
            if given:
                raise ValueError(
                    f"{', '.join(sorted(given))} set without server_opt: name one of {NAMES}"
                )
            return None
        name = str(name)
        if name == "fedavgm":
            unused = sorted(set(given) & {"beta2", "tau"})
            if unused:
                raise ValueError(
                    f"server_opt 'fedavgm' (server momentum) has no {' or '.join(unused)}: "
                    "remove it, or pick an adaptive optimizer"
                )
        lr = given.pop("server_lr", DEFAULT_SERVER_LR.get(name, 0.1))
        numbers = {k: float(v) for k, v in given.items()}  # type: ignore[arg-type]
        return cls(name=name, server_lr=float(lr), **numbers)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "server_lr": self.server_lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "tau": self.tau,
        }


@dataclass(frozen=True)
class ServerOptState:
    """What the optimizer remembers between rounds: steps taken and its moments."""

    step: int = 0
    m: Mapping[str, npt.NDArray[Any]] = field(default_factory=dict, repr=False)
    """First moment (server momentum for ``fedavgm``), one array per float model array."""
    v: Mapping[str, npt.NDArray[Any]] = field(default_factory=dict, repr=False)
    """Second moment (adaptive optimizers only)."""

    def arrays(self) -> dict[str, dict[str, npt.NDArray[Any]]]:
        """The moments as a checkpoint keeps them (name -> arrays)."""
        return {"m": dict(self.m), "v": dict(self.v)}

    @classmethod
    def restored(cls, step: int, arrays: Mapping[str, Arrays]) -> ServerOptState:
        """The state a checkpoint held: ``step`` and its moments (``m``, ``v``)."""
        unknown = sorted(set(arrays) - {"m", "v"})
        if unknown:
            raise ValueError(f"server optimizer state holds unknown moments {unknown}")
        if step > 0 and not arrays.get("m"):
            raise ValueError(f"the server optimizer took {step} steps but its moments are missing")
        return cls(step=step, m=dict(arrays.get("m", {})), v=dict(arrays.get("v", {})))


def pseudo_gradient(current: Arrays, mean: Arrays) -> dict[str, npt.NDArray[Any]]:
    """``current - mean`` for every floating-point array (Reddi et al.'s ``-Delta_t``)."""
    _check_same(current, mean)
    return {
        key: np.subtract(current[key], mean[key])
        for key in current
        if np.asarray(current[key]).dtype.kind in "fc"
    }


def server_step(
    config: ServerOptConfig, state: ServerOptState, current: Arrays, mean: Arrays
) -> tuple[dict[str, npt.NDArray[Any]], ServerOptState]:
    """One server step: the new global model from ``current`` (what was sent) and the
    round's folded ``mean``, and the optimizer's next state. Inputs are not modified.

    Computed in each array's own dtype (a float32 model keeps float32 moments: the
    checkpoint holds exactly what the next round reads).
    """
    gradient = pseudo_gradient(current, mean)
    beta1, beta2 = config.beta1, config.beta2
    m: dict[str, npt.NDArray[Any]] = {}
    v: dict[str, npt.NDArray[Any]] = {}
    new: dict[str, npt.NDArray[Any]] = {}
    for key, value in current.items():
        if key not in gradient:
            new[key] = np.array(mean[key], copy=True)  # counters: FedAvg's mean
            continue
        g = gradient[key]
        dtype = g.dtype.type
        previous_m = state.m.get(key)
        if previous_m is not None and previous_m.shape != g.shape:
            raise ValueError(
                f"server optimizer moment {key!r} has shape {previous_m.shape}, the model "
                f"{g.shape}: the checkpoint belongs to another model"
            )
        m_prev = np.zeros_like(g) if previous_m is None else previous_m
        if config.name == "fedavgm":
            m[key] = dtype(beta1) * m_prev + g
            new[key] = value - dtype(config.server_lr) * m[key]
            continue
        m[key] = dtype(beta1) * m_prev + dtype(1 - beta1) * g
        previous_v = state.v.get(key)
        v_prev = np.full_like(g, config.tau**2) if previous_v is None else previous_v
        g2 = g * g
        if config.name == "fedadagrad":
            v[key] = v_prev + g2
        elif config.name == "fedadam":
            v[key] = dtype(beta2) * v_prev + dtype(1 - beta2) * g2
        else:  # fedyogi
            v[key] = v_prev - dtype(1 - beta2) * g2 * np.sign(v_prev - g2)
        step = dtype(config.server_lr) * m[key] / (np.sqrt(v[key]) + dtype(config.tau))
        new[key] = value - step
    return new, ServerOptState(step=state.step + 1, m=m, v=v)


def _check_same(current: Arrays, mean: Arrays) -> None:
    if set(current) != set(mean):
        raise ValueError(
            f"the round's mean has arrays {list(mean)}, the model sent {list(current)}"
        )
    for key in current:
        a, b = np.asarray(current[key]), np.asarray(mean[key])
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"array {key!r}: the round's mean is {b.shape} {b.dtype}, the model sent "
                f"{a.shape} {a.dtype}"
            )

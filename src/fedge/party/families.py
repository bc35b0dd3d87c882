"""Model families: the code that builds a registry model's network in torch, to train it.

A registry entry that can be trained carries a :class:`~fedge.protocols.manifest.Trainable`
(family name, size parameters, hashed weights) and a
:class:`~fedge.protocols.manifest.Preprocess`. A station asked to train builds the
network from its family, loads the weights the round sent, and feeds it images prepared
as the manifest says.

Shipped families:

=====================  ==================================================================
``inspection-cnn``      :class:`fedge.models.inspection.InspectionNet`; params ``width``
                        (default 16) and ``image_size`` (32); 1 channel, pixels / 255
``digits-mlp``          the digits MLPs (``fedge.models.digits``); param ``hidden`` picks
                        ``mlp-small`` (16), ``mlp`` (64) or ``mlp-large`` (256)
=====================  ==================================================================

A family may name sizes of itself (``architectures``: a name -> the params it overrides),
so a distilling job can give each TiFL tier its own size (FedDF across tiers; a slow tier
gets the compact one): ``inspection-cnn`` has ``cnn-large`` (width 16), ``cnn`` (8) and
``cnn-small`` (4); ``digits-mlp`` has the simulator's ``mlp-large``, ``mlp`` and
``mlp-small``. A round's config names the architecture (``arch``); a station asked for one
its family does not have answers with an error (:func:`architecture_params`).

A user adds a family with a Python entry point in the group ``fedge.model_families``
whose object is a :class:`Family`, e.g. in their package's ``pyproject.toml``::

    [project.entry-points."fedge.model_families"]
    my-resnet = "my_package.fedge_family:FAMILY"

Every station that trains that model needs the package installed; a station that
cannot build a family answers the round with an error naming it (the run store records
it), and keeps serving.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedge.models.architectures import Architectures
from fedge.party.errors import FamilyError
from fedge.protocols.manifest import Preprocess
from fedge.protocols.model_spec import ModelSpec

ENTRY_POINT_GROUP = "fedge.model_families"


@dataclass(frozen=True)
class Family:
    """How to build, prepare inputs for and augment one kind of network."""

    name: str
    build: Callable[[Mapping[str, int], int], nn.Module]
    """(size params, number of classes) -> a freshly initialised network returning logits."""
    preprocess: Callable[[Mapping[str, int]], Preprocess]
    # Label-preserving flips and quarter turns (surfaces have no orientation).
    augment_symmetries: bool = False
    architectures: Mapping[str, Mapping[str, int]] = field(default_factory=dict, hash=False)
    """Named sizes of the family: architecture name -> the params it sets."""


def _inspection(params: Mapping[str, int], n_classes: int) -> nn.Module:
    from fedge.models.inspection import InspectionNet

    return InspectionNet(n_classes=n_classes, width=int(params.get("width", 16)))


def _inspection_preprocess(params: Mapping[str, int]) -> Preprocess:
    return Preprocess(image_size=int(params.get("image_size", 32)), channels=1)


_DIGITS_HIDDEN = {16: "mlp-small", 64: "mlp", 256: "mlp-large"}


def _digits(params: Mapping[str, int], n_classes: int) -> nn.Module:
    from fedge.models import digits

    hidden = int(params.get("hidden", 64))
    if hidden not in _DIGITS_HIDDEN:
        raise FamilyError(f"digits-mlp: hidden must be one of {sorted(_DIGITS_HIDDEN)}")
    if n_classes != digits.N_CLASSES:
        raise FamilyError(f"digits-mlp has {digits.N_CLASSES} classes, not {n_classes}")
    return digits.make_model(_DIGITS_HIDDEN[hidden])


class _Flatten(nn.Module):
    """Images ``(n, 1, 8, 8)`` -> the digits MLP's 64 features (scaled 0..16 as sklearn)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(torch.flatten(x, 1))
        return out


SHIPPED: dict[str, Family] = {
    "inspection-cnn": Family(
        "inspection-cnn",
        _inspection,
        _inspection_preprocess,
        augment_symmetries=True,
        architectures={
            "cnn-large": {"width": 16},
            "cnn": {"width": 8},
            "cnn-small": {"width": 4},
        },
    ),
    "digits-mlp": Family(
        "digits-mlp",
        lambda params, n: _Flatten(_digits(params, n)),
        lambda params: Preprocess(image_size=8, channels=1, scale=16.0 / 255.0),
        architectures={name: {"hidden": hidden} for hidden, name in _DIGITS_HIDDEN.items()},
    ),
}


@functools.cache
def _installed() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            family = entry.load()
        except Exception as exc:  # a user's package: report it as the family's problem
            raise FamilyError(f"model family {entry.name!r} failed to load: {exc}") from exc
        if not isinstance(family, Family):
            raise FamilyError(
                f"entry point {entry.value!r} ({ENTRY_POINT_GROUP}) is not a fedge Family"
            )
        found[entry.name] = family
    return found


def get_family(name: str) -> Family:
    """The family called ``name``: shipped, or installed through an entry point."""
    if name in SHIPPED:
        return SHIPPED[name]
    installed = _installed()
    if name in installed:
        return installed[name]
    known = ", ".join(sorted({*SHIPPED, *installed}))
    raise FamilyError(
        f"this station cannot build model family {name!r} (known here: {known}); "
        f"install the package that provides it (entry point group {ENTRY_POINT_GROUP!r})"
    )


def build(name: str, params: Mapping[str, int], n_classes: int, seed: int = 0) -> nn.Module:
    """A fresh network of family ``name`` (the same weights for the same seed)."""
    family = get_family(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return family.build(params, n_classes)
        except FamilyError:
            raise
        except Exception as exc:
            raise FamilyError(f"family {name!r} cannot build {dict(params)}: {exc}") from exc


# ---------------------------------------------------------------- named sizes (tiers)


def architecture_params(family: str, params: Mapping[str, int], arch: str) -> dict[str, int]:
    """``params`` with architecture ``arch`` of ``family`` applied (its size params set).

    A FamilyError names the family's architectures when it has no ``arch``: a station
    answers such a round with an error, and trains nothing."""
    named = get_family(family).architectures
    if arch not in named:
        known = ", ".join(sorted(named)) or "none"
        raise FamilyError(
            f"model family {family!r} has no architecture {arch!r} (known: {known}); "
            "name one of them in the job's strategy.params.tier_archs"
        )
    return {**params, **named[arch]}


def round_spec(spec: ModelSpec, arch: object) -> ModelSpec:
    """The spec a round trains: ``spec`` itself, or its family at size ``arch`` (the
    round config's ``arch``, set by a distilling job)."""
    if arch is None:
        return spec
    if not isinstance(arch, str) or not arch:
        raise FamilyError(f"config['arch'] must name an architecture, got {arch!r}")
    return ModelSpec(
        family=spec.family,
        params=architecture_params(spec.family, spec.params, arch),
        classes=spec.classes,
        preprocess=spec.preprocess,
    )


def architectures(spec: ModelSpec) -> Architectures:
    """The family of ``spec`` at each of its named sizes, for the server's distillation
    (:class:`~fedge.models.architectures.Architectures`: inputs as ``spec`` prepares them)."""
    family = get_family(spec.family)
    n_classes = len(spec.classes)

    def build_arch(arch: str, seed: int) -> nn.Module:
        return build(
            spec.family, architecture_params(spec.family, spec.params, arch), n_classes, seed
        )

    shape = (spec.preprocess.channels, spec.preprocess.image_size, spec.preprocess.image_size)
    return Architectures(
        names=frozenset(family.architectures),
        build=build_arch,
        sample_shape=shape,
        what=f"{spec.family} architecture",
    )


# ---------------------------------------------------------------- weights as arrays


def state_arrays(model: nn.Module) -> dict[str, npt.NDArray[np.generic]]:
    """The model's state dict as NumPy arrays, in the model's order."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_state_arrays(model: nn.Module, arrays: Mapping[str, npt.NDArray[np.generic]]) -> None:
    """Load arrays into ``model``; a FamilyError says which names or shapes do not fit."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise FamilyError(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name, tensor in expected.items():
        if np.asarray(arrays[name]).dtype.kind not in "fiub":
            raise FamilyError(f"weights do not fit the model: {name} is not numeric")
        if tuple(arrays[name].shape) != tuple(tensor.shape):
            raise FamilyError(
                f"weights do not fit the model: {name} is {tuple(arrays[name].shape)}, "
                f"the model wants {tuple(tensor.shape)}"
            )
    # Native byte order and the model's own dtype: a foreign-endian or widened array loads.
    model.load_state_dict(
        {
            k: torch.from_numpy(
                np.ascontiguousarray(
                    v, dtype=np.dtype(str(expected[k].dtype).removeprefix("torch."))
                )
            )
            for k, v in arrays.items()
        }
    )


def weights_bytes(arrays: Mapping[str, npt.NDArray[np.generic]]) -> bytes:
    """An ``.npz`` of the arrays (no pickles), the registry's trainable weights format."""
    buffer = io.BytesIO()
    named: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
    np.savez(buffer, **named)
    return buffer.getvalue()


def weights_from_bytes(data: bytes) -> dict[str, npt.NDArray[np.generic]]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as loaded:
            return {name: loaded[name] for name in loaded.files}
    except (ValueError, OSError, KeyError) as exc:
        raise FamilyError(f"weights are not a readable .npz: {exc}") from exc

"""Nested sub-models across TiFL tiers: HeteroFL's width slicing (Diao et al., ICLR 2021).

HeteroFL serves clients of different capability with sub-networks of ONE global model: a
client at width rate r trains the first r of the units of every hidden layer (a leading
slice of every weight and bias), and the server averages each parameter over the
clients whose sub-model holds it; a parameter no client held this round keeps its value.
Here the capability is the tier: ``tier_archs`` names one architecture per tier, fastest
first, and every one must be a leading slice of the largest, which is the global model
(``mlp-large-half`` of ``mlp-large``: the first 128 and 64 hidden units; the inspection
CNN at width 8 of the one at width 16: the first channels of every convolution).

Against FedDF (:mod:`fedge.aggregator.strategies.feddf`), which keeps one model per
architecture and fuses them through an unlabeled proxy set, the slow tiers' updates land
in the global model's own parameters: no proxy set and no server-side training. On
``tifl-digits-mixed`` (BENCHMARKS.md section 8f), with the slow tiers on half-width
slices, its final accuracy is within a point of FedAvg-large's and its converged
accuracy level with it; FedDF with the same architectures is within a point too, 0.7
points lower converged, and the size of the slow tiers' model is most of the difference
from FedDF's 1.1-point shortfall with a 10.6x smaller one. What nesting needs is
architectures that nest; distill fuses any.

Not used, and why: HeteroFL's "scaler" (a sub-model's activations scaled by 1/r while it
trains) and static batch norm exist for normalised networks; the MLPs and the inspection
CNN have no normalisation layers. FedRolex's rolling windows (Alam et al., NeurIPS 2022:
the slice moves by one unit each round, so every unit is trained by the small clients in
turn) were screened on this scenario with the quarter-width slice and lost up to 2.5
points of final accuracy and 1-7 of converged accuracy against the static slice. Our
reading, not measured: a TiFL round trains one tier, so a moving window leaves each unit
few consecutive updates (section 8f).

Pure functions (:func:`check_nested`, :func:`sub_model`, :func:`nested_mean`) carry the
arithmetic; :class:`NestedTieredFedAvg` wires them into TiFL's round loop with one
architecture per tier (:mod:`fedge.aggregator.strategies.architectures`, as FedDF's),
folding each reply into its architecture's running mean as it arrives.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedge.aggregator.errors import AggregatorError
from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.rounds.fold import StreamingMean, accumulator_dtype
from fedge.aggregator.rounds.replies import arrays_of, layout, to_array_record
from fedge.aggregator.strategies.architectures import TieredArchitectures
from fedge.models.architectures import DIGITS, Architectures

Shapes = Mapping[str, tuple[int, ...]]
Arrays = Mapping[str, npt.NDArray[Any]]


class NestingError(AggregatorError, ValueError):
    """An architecture that is not a leading slice of the global one (a ValueError too:
    the factory names the strategy's table for it)."""


def check_nested(inner: Shapes, outer: Shapes, *, name: str = "the sub-model") -> None:
    """Raise :class:`NestingError` unless every array of ``inner`` is a leading slice of
    the same-named array of ``outer`` (same names, same rank, no dimension larger)."""
    if set(inner) != set(outer):
        missing = sorted(set(outer) - set(inner))
        extra = sorted(set(inner) - set(outer))
        raise NestingError(
            f"{name} is not a slice of the global model: its arrays differ "
            f"(missing {missing}, extra {extra})"
        )
    for key, shape in inner.items():
        bound = outer[key]
        if len(shape) != len(bound) or any(s > b for s, b in zip(shape, bound, strict=True)):
            raise NestingError(
                f"{name} is not a slice of the global model: {key} is {list(shape)}, "
                f"the global model's {list(bound)}"
            )


def _leading(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def sub_model(global_arrays: Arrays, shapes: Shapes) -> dict[str, npt.NDArray[Any]]:
    """The sub-model of ``shapes`` cut from ``global_arrays``: each array's leading slice
    (a copy: what is sent must not change when the global model does)."""
    return {key: np.array(global_arrays[key][_leading(shape)]) for key, shape in shapes.items()}


def nested_mean(
    current: Arrays, means: Sequence[tuple[Arrays, float]]
) -> dict[str, npt.NDArray[Any]]:
    """The new global model from sub-models' weighted means (HeteroFL's aggregation).

    ``means`` holds one (mean arrays, total weight) per architecture that replied, each
    array a leading slice of ``current``'s. Every parameter becomes the weighted mean of
    the means that hold it; a parameter none holds keeps its ``current`` value.
    Accumulated in float64 (float32 models), as the folds are.
    """
    result: dict[str, npt.NDArray[Any]] = {}
    for key, value in current.items():
        base = np.asarray(value)
        total = np.zeros(base.shape, dtype=accumulator_dtype(base.dtype))
        weight = np.zeros(base.shape, dtype=np.float64)
        for arrays, w in means:
            if w <= 0:
                continue
            part = np.asarray(arrays[key])
            where = _leading(part.shape)
            total[where] += w * part
            weight[where] += w
        covered = weight > 0
        out = base.copy()
        out[covered] = (total[covered] / weight[covered]).astype(base.dtype)
        result[key] = out
    return result


class NestedTieredFedAvg(TieredArchitectures):
    """TiFL tiers whose architectures are nested slices of one global model (module
    docstring). The global model is the largest of ``tier_archs``."""

    def __init__(
        self,
        *,
        tier_archs: Sequence[str],
        architectures: Architectures = DIGITS,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("server_opt") is not None:
            raise ValueError(
                "server_opt: nested has no server optimizer yet (a step on a mean that "
                "covers some parameters and not others is untried); use kind 'tiered' "
                "with server_opt, or nested without it"
            )
        super().__init__(tier_archs=tier_archs, architectures=architectures, **kwargs)
        self.shapes: dict[str, dict[str, tuple[int, ...]]] = {
            arch: {k: tuple(v.shape) for k, v in architectures.build(arch, 0).state_dict().items()}
            for arch in dict.fromkeys(self.tier_archs)
        }
        for arch in self.shapes:
            check_nested(self.shapes[arch], self.shapes[self.evaluation_arch], name=repr(arch))

    def _messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        plan: deadlines.RoundPlan,
    ) -> list[Message]:
        found = {k: shape for k, (shape, _) in layout(arrays).items()}
        if found != self.shapes[self.evaluation_arch]:
            raise ValueError(
                f"nested: the global arrays must be a {self.evaluation_arch!r} model (the "
                "largest of tier_archs)"
            )
        return super()._messages(server_round, arrays, config, plan)

    def model_for(self, arch: str, arrays: ArrayRecord) -> ArrayRecord:
        """The global model itself for the largest architecture, else its slice."""
        if arch == self.evaluation_arch:
            return arrays
        return to_array_record(sub_model(arrays_of(arrays), self.shapes[arch]))

    def aggregate(
        self,
        server_round: int,
        arrays: ArrayRecord,
        folds: dict[str, StreamingMean],
        metrics: dict[str, float],
    ) -> ArrayRecord:
        """Each architecture's mean, then every parameter averaged over the means that
        hold it (:func:`nested_mean`)."""
        means = [
            (fold.result(), fold.total_weight)
            for fold in folds.values()
            if fold.count and fold.total_weight > 0
        ]
        if not means:
            return arrays
        return to_array_record(nested_mean(arrays_of(arrays), means))

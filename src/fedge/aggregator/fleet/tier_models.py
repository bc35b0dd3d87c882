"""Fleet jobs with one architecture per tier, one model each: ``distill`` and ``nested``.

FedDF across TiFL tiers on real stations (issue 32, item 7): the fast tiers train the
large model, the slow tiers a compact one (KnowledgeNet's edge student), the server fuses
them by ensemble distillation on its unlabeled proxy set -- the strategy the simulator
runs (:class:`~fedge.aggregator.strategies.feddf.DistillingTieredFedAvg`), handed the
task model's family at its named sizes. Its manifest adds to a fleet job's::

    [strategy]
    kind = "distill"
    [strategy.params]
    tiers = 2
    tier_archs = ["cnn-large", "cnn-small"]   # fastest tier first; the family's sizes

    [distill]
    proxy = "proxy-images"   # a directory of unlabeled images (relative to the manifest)
    max_images = 2000        # at most this many of them, in name order

Beside a fleet job's files its directory holds::

    proxy.npy            the proxy images as the model takes them (prepared once)
    tier-models.json     once the job ended: each station's architecture (its final tier)
    final-<arch>.npz     each architecture's final model

and the job publishes one model per architecture, ``<publish.name>-<arch>``, each deployed
to the stations of its tier (:mod:`fedge.federation.tier_publish`).

A ``nested`` job (HeteroFL, :mod:`fedge.aggregator.strategies.nested`) names its tiers'
architectures the same way, each a slice of the largest (the inspection CNN at width 8
or 4 of width 16); it needs no ``[distill]`` table (no proxy set), and its architectures'
final models are cut from the final global one. It writes the same files and publishes
the same way.

Here: the manifest's pure checks, and the files (no registry, no fleet).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from fedge.aggregator.jobs.checkpoint import atomic_write_text, load_arrays, save_arrays
from fedge.aggregator.jobs.directory import FINAL_MODEL, JobError
from fedge.aggregator.jobs.spec import ManifestError
from fedge.aggregator.rounds.replies import arrays_of, to_array_record
from fedge.aggregator.strategies.factory import TIER_ARCH_KINDS
from fedge.aggregator.tiers.architectures import (
    TierArchitectureError,
    assign,
    check_tier_archs,
)
from fedge.protocols.model_spec import ModelSpec
from fedge.toml_table import TomlTable

if TYPE_CHECKING:
    from fedge.models.architectures import Architectures

DISTILL = "distill"
NESTED = "nested"
# TIER_ARCH_KINDS (the factory's): the kinds that give each tier its architecture; a
# fleet job of one publishes one model per architecture.
PROXY = "proxy.npy"
TIER_MODELS = "tier-models.json"
DISTILL_KEYS = (
    "tier_archs",
    "temperature",
    "distill_epochs",
    "distill_lr",
    "distill_batch_size",
    "distill_validation",
    "distill_patience",
)
_DEFAULT_TIERS = 5  # TieredFedAvg's


@dataclass(frozen=True)
class DistillSpec:
    """``[distill]``: the server's unlabeled proxy images."""

    proxy: str
    max_images: int = 2000


def parse_distill(
    kind: str, params: Mapping[str, object], table: TomlTable | None
) -> DistillSpec | None:
    """The ``[distill]`` table of a ``distill`` job (None for any other kind), and the
    tier architectures of a ``distill`` or ``nested`` job checked: one per tier.
    ManifestError naming the field."""
    if kind != DISTILL and table is not None:
        raise ManifestError(f'[distill] is only for strategy.kind = "distill", not {kind!r}')
    if kind not in TIER_ARCH_KINDS:
        return None
    tiers = params.get("tiers", _DEFAULT_TIERS)
    if not isinstance(tiers, int) or isinstance(tiers, bool) or tiers < 1:
        raise ManifestError(f"strategy.params.tiers must be an integer >= 1, got {tiers!r}")
    try:
        check_tier_archs(params.get("tier_archs"), tiers, kind)
    except TierArchitectureError as exc:
        raise ManifestError(str(exc)) from None
    if kind == NESTED:  # slices of the global model: no proxy set, nothing distilled
        distilling = sorted(set(params) & set(DISTILL_KEYS) - {"tier_archs"})
        if distilling:
            raise ManifestError(
                f"strategy.params.{distilling[0]}: not a parameter of nested (it distils "
                'nothing; kind = "distill" does)'
            )
        return None
    if table is None:
        raise ManifestError(
            "[distill] is missing: kind \"distill\" fuses the tiers' models on the server's "
            'unlabeled images; add [distill] proxy = "DIR" (a directory of images)'
        )
    return DistillSpec(
        proxy=table.text("proxy", non_empty=True),
        max_images=table.integer("max_images", minimum=1, default=2000),
    )


def tiered_params(params: Mapping[str, object]) -> dict[str, object]:
    """A distill or nested job's strategy params less its own: what a tiered strategy
    checks before the stations' model family is known (the full strategy is built when
    it is). A nested job with distill's keys was refused already (:func:`parse_distill`)."""
    return {k: v for k, v in params.items() if k not in DISTILL_KEYS}


def tier_archs(params: Mapping[str, object], kind: str = DISTILL) -> tuple[str, ...]:
    tiers = params.get("tiers", _DEFAULT_TIERS)
    count = int(tiers) if isinstance(tiers, int) else 0
    return check_tier_archs(params.get("tier_archs"), count, kind)


# ---------------------------------------------------------------- the job directory's files


def load_proxy(job_dir: Path) -> npt.NDArray[np.float32]:
    path = job_dir / PROXY
    try:
        proxy: npt.NDArray[np.float32] = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ManifestError(f"the job's proxy set {path} cannot be read: {exc}") from exc
    return proxy


def write_tier_models(
    job_dir: Path,
    parties: Mapping[str, int],
    tiers: Any,
    archs: tuple[str, ...],
    largest: str,
    models: Mapping[str, Any],
) -> None:
    """Each architecture's final model, then which station serves which (written last:
    its presence says the models are there). ``models``: arch -> ArrayRecord."""
    for arch, record in models.items():
        save_arrays(job_dir / f"final-{arch}.npz", arrays_of(record))
    stations = assign(parties, tiers, archs, largest)
    atomic_write_text(
        job_dir / TIER_MODELS,
        json.dumps({"tier_archs": list(archs), "stations": stations}, indent=1, sort_keys=True),
    )


@dataclass(frozen=True)
class TierModels:
    """What a distilling job left: its architectures and each station's."""

    tier_archs: tuple[str, ...]
    stations: dict[str, str]

    def arrays(self, job_dir: Path, arch: str) -> dict[str, npt.NDArray[Any]]:
        return dict(load_arrays(job_dir / f"final-{arch}.npz"))


def read_tier_models(job_dir: Path) -> TierModels:
    path = job_dir / TIER_MODELS
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return TierModels(
            tier_archs=tuple(str(a) for a in data["tier_archs"]),
            stations={str(k): str(v) for k, v in data["stations"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ManifestError(
            f"{path} cannot be read ({exc}): the distilling job did not leave its tier "
            "models; resume it (`fedge aggregator resume --dir`) to write them"
        ) from exc


# ---------------------------------------------------------------- the ServerApp's side

ArchitectureSource = Callable[["ModelSpec"], "Architectures"]
"""The stations' model family at its named sizes (:func:`fedge.party.families.architectures`),
handed to the aggregator by the ServerApp that runs a distill job
(:mod:`fedge.federation.tier_server`): the aggregator cannot import the party's families."""


def distill_inputs(
    kind: str, job_dir: Path, spec_text: str, architectures: ArchitectureSource | None
) -> dict[str, Any]:
    """What :func:`~fedge.aggregator.strategies.factory.build_strategy` needs besides the
    params for a distill job (the proxy set and the catalogue) or a nested one (the
    catalogue); nothing for another kind."""
    if kind not in TIER_ARCH_KINDS:
        return {}
    if architectures is None:
        raise JobError(
            f"a {kind} job runs under fedge.federation.tier_server:app, which builds the "
            "stations' model family; this ServerApp cannot: prepare the job again "
            "(`fedge aggregator run`) so that its app names the right ServerApp"
        )
    catalogue = architectures(ModelSpec.from_json(spec_text))
    if kind == NESTED:
        return {"architectures": catalogue}
    return {"proxy_X": load_proxy(job_dir), "architectures": catalogue}


def tier_finish(job_dir: Path, parties: Mapping[str, int]) -> Callable[[Any], None]:
    """The job's last step once its final model is written: each architecture's model
    (a distilling strategy's own; a nested one's cut from the final global model) and
    each station's architecture (:func:`write_tier_models`)."""

    def finish(strategy: Any) -> None:
        from fedge.aggregator.strategies.feddf import DistillingTieredFedAvg  # torch
        from fedge.aggregator.strategies.nested import NestedTieredFedAvg, sub_model

        if isinstance(strategy, DistillingTieredFedAvg):
            models = strategy.models
        elif isinstance(strategy, NestedTieredFedAvg):
            final = dict(load_arrays(job_dir / FINAL_MODEL))
            models = {
                arch: to_array_record(sub_model(final, shapes))
                for arch, shapes in strategy.shapes.items()
            }
        else:
            return
        write_tier_models(
            job_dir,
            parties,
            strategy.final_tiers(),
            strategy.tier_archs,
            strategy.evaluation_arch,
            models,
        )

    return finish

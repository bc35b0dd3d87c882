"""Preparing a distill or nested fleet job: its tiers' architectures checked against the
stations' model family and the training stations, and (distill) the server's proxy
images read once.

Every check runs before the job directory is written (:func:`fedge.federation.prepare
.prepare` calls :func:`check_tiers` first), so a bad manifest creates nothing:

- the task model's family names every ``tier_archs`` entry (else the error lists the
  family's architectures), and the starting weights are its largest's (FedDF returns
  the largest as the global model; nested cuts the others from it, and refuses
  architectures that are not slices of it);
- there are at least as many training stations as tiers (a tier with no stations would
  have its model published for nobody);
- the ``[distill] proxy`` directory holds readable images (the server's unlabeled data:
  the stations' own images never leave them).
"""

from __future__ import annotations

import io
import tomllib
from pathlib import Path

import numpy as np
import numpy.typing as npt

from fedge.aggregator.fleet.manifest import FleetJobManifest, validate_strategy
from fedge.aggregator.fleet.tier_models import PROXY, tier_archs
from fedge.aggregator.jobs.checkpoint import atomic_write
from fedge.aggregator.jobs.directory import JOB_MANIFEST
from fedge.aggregator.jobs.spec import ManifestError
from fedge.aggregator.strategies.factory import TIER_ARCH_KINDS
from fedge.aggregator.tiers.architectures import TierArchitectureError
from fedge.party import families
from fedge.party.errors import FamilyError
from fedge.party.preprocess import ImageError, prepare_many
from fedge.protocols.model_spec import ModelSpec

FLEET_SERVERAPP = "fedge.aggregator.fleet.server:app"
TIER_SERVERAPP = "fedge.federation.tier_server:app"
IMAGE_SUFFIXES = frozenset((".png", ".jpg", ".jpeg", ".bmp", ".pgm"))
_DEFAULT_TIERS = 5


def check_tiers(
    manifest: FleetJobManifest,
    spec: ModelSpec,
    weights: bytes,
    *,
    manifest_dir: Path,
    stations: int,
) -> npt.NDArray[np.float32] | None:
    """A distill or nested job's checks (nothing for any other kind); returns a distill
    job's proxy set (None for any other)."""
    if manifest.kind not in TIER_ARCH_KINDS:
        return None
    try:
        archs = tier_archs(manifest.params, manifest.kind)
    except TierArchitectureError as exc:
        raise ManifestError(str(exc)) from None
    tiers = manifest.params.get("tiers", _DEFAULT_TIERS)
    if isinstance(tiers, int) and tiers > stations:
        raise ManifestError(
            f"strategy.params.tiers is {tiers}, but only {stations} station(s) of the job "
            "have training enabled: a tier would have no stations and its model nobody to "
            "serve it; use fewer tiers or enable training on more stations"
        )
    try:
        catalogue = families.architectures(spec)
    except FamilyError as exc:
        raise ManifestError(f"task.model: {exc}") from None
    try:
        catalogue.check(archs)
    except ValueError as exc:  # names the unknown ones and the family's known ones
        raise ManifestError(f"strategy.params.{exc}") from None
    largest = max(archs, key=catalogue.parameters)
    try:
        model = catalogue.build(largest, 0)
        families.load_state_arrays(model, families.weights_from_bytes(weights))
    except FamilyError as exc:
        raise ManifestError(
            f"task.model: its weights must be the largest tier architecture's ({largest}), "
            f"the global model: {exc}"
        ) from None
    if manifest.distill is None:  # nested: no proxy set
        validate_strategy(manifest, stations, architectures=catalogue)
        return None
    proxy = read_proxy(manifest_dir, manifest.distill.proxy, manifest.distill.max_images, spec)
    validate_strategy(manifest, stations, architectures=catalogue, proxy_X=proxy)
    return proxy


def read_proxy(
    manifest_dir: Path, proxy: str, max_images: int, spec: ModelSpec
) -> npt.NDArray[np.float32]:
    """The proxy images (relative to the manifest's directory), as the model takes them."""
    directory = Path(proxy) if Path(proxy).is_absolute() else manifest_dir / proxy
    if not directory.is_dir():
        raise ManifestError(
            f"distill.proxy: {directory} is not a directory (it must hold the server's "
            "unlabeled images)"
        )
    paths = sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise ManifestError(
            f"distill.proxy: {directory} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    try:
        return prepare_many(paths[:max_images], spec.preprocess)
    except ImageError as exc:
        raise ManifestError(f"distill.proxy: {exc}") from None


def write_proxy(job_dir: Path, proxy: npt.NDArray[np.float32] | None) -> None:
    if proxy is None:
        return
    buffer = io.BytesIO()
    np.save(buffer, proxy, allow_pickle=False)
    atomic_write(job_dir / PROXY, lambda handle: handle.write(buffer.getvalue()))


def serverapp_of(job_dir: Path) -> str:
    """The ServerApp the job's Flower app names: a distill or nested job's is handed the
    stations' model family (:mod:`fedge.federation.tier_server`)."""
    try:
        document = tomllib.loads((job_dir / JOB_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return FLEET_SERVERAPP
    strategy = document.get("strategy")
    kind = strategy.get("kind") if isinstance(strategy, dict) else None
    return TIER_SERVERAPP if kind in TIER_ARCH_KINDS else FLEET_SERVERAPP

"""Preparing a fleet job: checked against the manager's store, then its job directory.

Nothing is written before every check passed: the fleet is this home's, every named edge
is enrolled and has training enabled in its desired config, the model is in the registry
with trainable weights that match its signed manifest and build with their family, and
``min_parties``/``per_round`` fit the stations that train. Then the job directory gets the
manifest, the model spec the stations build, the starting weights, the edge -> party
map, a queued run in its run store, and the Flower app ``flwr run`` submits. An anomaly
job's backbone is built here too, so a model whose features do not fit its images is
refused before anything is written; the shape of its statistics goes in ``anomaly.json``.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from fedge.aggregator.anomaly.rounds import write_shape
from fedge.aggregator.fleet.grids import NODE_ID_BASE
from fedge.aggregator.fleet.manifest import (
    FleetJobManifest,
    load_fleet_manifest,
    validate_strategy,
)
from fedge.aggregator.fleet.server import INITIAL_WEIGHTS, MODEL_SPEC, PARTIES
from fedge.aggregator.jobs.checkpoint import atomic_write_text
from fedge.aggregator.jobs.directory import (
    JOB_MANIFEST,
    RUNS_DB,
    JobError,
)
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.jobs.spec import ManifestError
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import job_store as fleet_job_store
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.registry.versions import PublishedModel, Registry, parse_ref
from fedge.federation.anomaly import anomaly_backbone_shape
from fedge.federation.tier_prepare import check_tiers, serverapp_of, write_proxy
from fedge.party import families
from fedge.party.errors import FamilyError
from fedge.protocols.model_spec import ModelSpec

APP_DIR = "app"
STATION_CLIENTAPP = "fedge.party.station_app:app"
ANOMALY_CLIENTAPP = "fedge.party.anomaly_app:app"


def prepare(
    manifest_path: Path,
    job_dir: Path,
    home: ManagerHome,
    *,
    edges: Sequence[str] | None = None,
) -> FleetJobManifest:
    """Validate a fleet job against the manager's store, then write its job directory.

    ``edges``: the stations the job's queue placed it on (issue 31), in place of the
    manifest's ``federation.edges``; each must have training enabled."""
    manifest = load_fleet_manifest(manifest_path)
    if edges is not None:
        manifest = dataclasses.replace(
            manifest,
            federation=dataclasses.replace(manifest.federation, edges=tuple(sorted(edges))),
        )
    if (job_dir / RUNS_DB).exists():
        raise JobError(
            f"{job_dir} already holds a job; resume it (`fedge aggregator resume --dir "
            f"{job_dir}`) or choose another --dir"
        )
    with ManagerView(home) as (fleet, registry):
        edges = _training_edges(manifest, fleet)
        model = _trainable_model(manifest, registry)
        weights = model.verified_weights()
    trainable = model.manifest.trainable
    preprocess = model.manifest.preprocess
    assert trainable is not None and preprocess is not None
    spec = ModelSpec(
        family=trainable.family,
        params=dict(trainable.params),
        classes=model.manifest.classes,
        preprocess=preprocess,
    )
    _check_family(spec, weights)
    anomaly_shape = (
        None if manifest.anomaly is None else anomaly_backbone_shape(manifest, spec, weights)
    )
    federation = manifest.federation
    for key, value in (
        ("min_parties", federation.min_parties),
        ("per_round", federation.per_round),
    ):
        if value > len(edges):
            raise ManifestError(
                f"federation.{key} is {value}, but only {len(edges)} edge(s) of the job "
                "have training enabled"
            )
    # The strategy again, now that the stations are counted (e.g. SecAgg+'s threshold).
    try:
        validate_strategy(manifest, parties=len(edges))
    except ManifestError as exc:
        raise ManifestError(
            f"{exc} ({len(edges)} edge(s) of the job have training enabled)"
        ) from None
    # A distill job: its tiers' architectures, its stations and its proxy images.
    proxy = check_tiers(
        manifest, spec, weights, manifest_dir=manifest_path.parent, stations=len(edges)
    )
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / INITIAL_WEIGHTS).write_bytes(weights)
    write_proxy(job_dir, proxy)
    atomic_write_text(job_dir / MODEL_SPEC, spec.to_json())
    parties = {edge: NODE_ID_BASE + index for index, edge in enumerate(sorted(edges))}
    atomic_write_text(job_dir / PARTIES, json.dumps(parties, indent=1))
    atomic_write_text(job_dir / JOB_MANIFEST, manifest.text)
    if anomaly_shape is not None:
        write_shape(job_dir, *anomaly_shape)
    _write_app(job_dir, ANOMALY_CLIENTAPP if manifest.is_anomaly else STATION_CLIENTAPP)
    store = RunStore(job_dir / RUNS_DB)
    try:
        store.create_run(f"{manifest.name}-{uuid.uuid4().hex[:8]}", manifest.text, RunState.QUEUED)
    finally:
        store.close()
    # The manager knows the jobs run on its fleet (the console's jobs page reads them).
    with ManagerView(home) as (fleet, _):
        fleet_job_store.record(
            fleet.store, str(job_dir.resolve()), manifest.name, manifest.task.model, time.time()
        )
    return manifest


class ManagerView:
    """The manager's store, fleet and registry for the length of a block."""

    def __init__(self, home: ManagerHome) -> None:
        self.fleet = Fleet.open(home)
        self.store = self.fleet.store
        self.registry = self.fleet.registry

    def __enter__(self) -> tuple[Fleet, Registry]:
        return self.fleet, self.registry

    def __exit__(self, *exc: object) -> None:
        self.store.close()


def _training_edges(manifest: FleetJobManifest, fleet: Fleet) -> list[str]:
    if manifest.federation.fleet != fleet.fleet:
        raise ManifestError(
            f"federation.fleet is {manifest.federation.fleet!r}, but this manager home "
            f"runs fleet {fleet.fleet!r}"
        )
    enrolled = fleet.edges()
    named = enrolled if manifest.federation.edges == "all" else list(manifest.federation.edges)
    unknown = sorted(set(named) - set(enrolled))
    if unknown:
        raise ManifestError(
            f"federation.edges: unknown edge(s) {', '.join(unknown)} in fleet {fleet.fleet} "
            "(see `fedge edge list`)"
        )
    training = [e for e in named if _trains(fleet, e)]
    if manifest.federation.edges != "all":
        off = sorted(set(named) - set(training))
        if off:
            raise ManifestError(
                f"federation.edges: training is disabled on {', '.join(off)}; enable it with "
                f"`fedge edge set-training {off[0]} --enable`"
            )
    if not training:
        raise ManifestError(
            "federation.edges: no edge of the job has training enabled "
            "(`fedge edge set-training EDGE --enable`)"
        )
    return training


def _trains(fleet: Fleet, edge: str) -> bool:
    config = fleet.desired_config(edge)
    return config is not None and config.training is not None and config.training.enabled


def _trainable_model(manifest: FleetJobManifest, registry: Registry) -> PublishedModel:
    name, version = parse_ref(manifest.task.model)
    try:
        model = registry.get(name, version)
    except ManagerError as exc:
        raise ManifestError(f"task.model: {exc}") from None
    if model.manifest.trainable is None or model.manifest.preprocess is None:
        raise ManifestError(
            f"task.model: {model.manifest.ref} cannot be trained (published without "
            "trainable weights and preprocessing); publish a version with --weights and --family"
        )
    return model


def _check_family(spec: ModelSpec, weights: bytes) -> None:
    """The family builds here and the starting weights fit it (else nothing can train)."""
    try:
        model = families.build(spec.family, spec.params, len(spec.classes))
        families.load_state_arrays(model, families.weights_from_bytes(weights))
    except FamilyError as exc:
        raise ManifestError(f"task.model: {exc}") from None


def _write_app(job_dir: Path, clientapp: str) -> None:
    """The Flower app ``flwr run`` submits: fedge's apps, configured with this job dir."""
    app = job_dir / APP_DIR
    app.mkdir(exist_ok=True)
    atomic_write_text(
        app / "pyproject.toml",
        "\n".join(
            [
                "# Written by fedge for one fleet job; `flwr run` submits this directory.",
                "[build-system]",
                'requires = ["hatchling"]',
                'build-backend = "hatchling.build"',
                "",
                "[project]",
                'name = "fedge-fleet-job"',
                'version = "1.0.0"',
                'license = "Apache-2.0"',
                "dependencies = []",
                "",
                "[tool.flwr.app]",
                'publisher = "fedge"',
                "",
                "[tool.flwr.app.components]",
                f'serverapp = "{serverapp_of(job_dir)}"',
                f'clientapp = "{clientapp}"',
                "",
                "[tool.flwr.app.config]",
                f"job-dir = {json.dumps(str(job_dir.resolve()))}",
                "",
            ]
        ),
    )

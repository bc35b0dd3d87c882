"""Publishing a completed distill or nested fleet job: one model per tier, each to its
tier's stations.

A distill job leaves each architecture's final model and each station's architecture (its
final TiFL tier; :mod:`fedge.aggregator.fleet.tier_models`). Here, under the job's lock:

1. every architecture must have a station (else nothing is published: a model for nobody
   is a sign the tiers did not form as the manifest planned);
2. every model is exported to ONNX (checked against torch) before any is published;
3. each is published as ``<publish.name>-<arch>`` (version: latest + 1), signed, with its
   lineage (the job, the stations of its tier and their examples, the task model);
4. each is deployed to its tier's stations through the desired configuration
   (:meth:`~fedge.edge_manager.fleet.operations.Fleet.deploy`): the agents fetch, verify,
   smoke-test and swap as for any deployment.

``published.json`` records what was published, then what was deployed: a ``resume`` after
a kill publishes nothing twice (a version of this run is found by its lineage) and
deploys only what was not.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fedge.aggregator.fleet.manifest import FleetJobManifest, load_fleet_manifest
from fedge.aggregator.fleet.server import MODEL_SPEC
from fedge.aggregator.fleet.tier_models import (
    DISTILL,
    NESTED,
    TIER_MODELS,
    read_tier_models,
)
from fedge.aggregator.jobs.checkpoint import atomic_write_text
from fedge.aggregator.jobs.directory import JOB_MANIFEST, RUNS_DB, JobError
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.strategies.factory import TIER_ARCH_KINDS
from fedge.aggregator.tiers.architectures import TierArchitectureError, stations_by_architecture
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.registry.versions import TrainableSource, parse_ref
from fedge.edge_manager.scheduler import owned_models
from fedge.federation.prepare import ManagerView
from fedge.party import families
from fedge.protocols.manifest import Lineage
from fedge.protocols.model_spec import ModelSpec

PUBLISHED = "published.json"
# How a tier's model came to be, for its lineage note.
_HOW = {
    DISTILL: "fused by ensemble distillation (FedDF)",
    NESTED: "a nested slice of the global model (HeteroFL)",
}


def is_tier_job(job_dir: Path) -> bool:
    """Whether the job in ``job_dir`` is a distill or nested job (it publishes one model
    per tier)."""
    return load_fleet_manifest(job_dir / JOB_MANIFEST).kind in TIER_ARCH_KINDS


def tier_name(publish_name: str, arch: str) -> str:
    return f"{publish_name}-{arch}"


def publish_tiers(job_dir: Path, home: ManagerHome) -> str:
    """Publish and deploy each tier's model once; returns the refs, comma-separated.
    The caller holds the job's lock."""
    record = _record(job_dir)
    manifest = load_fleet_manifest(job_dir / JOB_MANIFEST)
    if "tiers" not in record:
        run_id, examples = _completed_run(job_dir)
        tiers = read_tier_models(job_dir)
        try:
            stations = stations_by_architecture(tiers.stations, tiers.tier_archs)
        except TierArchitectureError as exc:
            raise JobError(f"job {run_id}: {exc}") from None
        exported = {arch: _export(job_dir, arch) for arch in stations}  # all, before any
        refs = _publish(home, manifest, run_id, stations, exported, examples)
        with ManagerView(home) as (fleet, _):  # a team's queued job: the team's models
            for ref in refs.values():
                name, version = parse_ref(ref)
                owned_models.own_published(fleet.store, job_dir, name, version, time.time())
        record = {"ref": ", ".join(refs.values()), "tiers": refs, "stations": stations}
        atomic_write_text(job_dir / PUBLISHED, json.dumps({**record, "at": time.time()}))
    deployed: dict[str, str] = dict(record.get("deployed", {}))
    if len(deployed) < len(record["tiers"]):
        with ManagerView(home) as (fleet, _):
            for arch, ref in record["tiers"].items():
                if arch in deployed:
                    continue
                name, version = parse_ref(ref)
                deployed[arch] = fleet.deploy(name, version, list(record["stations"][arch]))
                record["deployed"] = deployed
                atomic_write_text(job_dir / PUBLISHED, json.dumps({**record, "at": time.time()}))
    return str(record["ref"])


def _record(job_dir: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((job_dir / PUBLISHED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data


def _completed_run(job_dir: Path) -> tuple[str, dict[str, int]]:
    """The run's id and each station's training examples (as the lineage names them)."""
    store = RunStore(job_dir / RUNS_DB)
    try:
        run = store.runs()[-1]
        run_id = str(run["run_id"])
        if run["state"] != RunState.COMPLETED:
            raise JobError(f"job {run_id} has not completed; nothing to publish")
        names = store.party_names(run_id)
        examples: dict[str, int] = {}
        for row in store.party_metrics(run_id):
            name = names.get(int(row["party"]), str(row["party"]))
            examples[name] = max(examples.get(name, 0), int(row["metrics"].get("num-examples", 0)))
    finally:
        store.close()
    if not examples:
        raise JobError(f"no station trained in job {run_id}; nothing to publish")
    if not (job_dir / TIER_MODELS).exists():
        raise JobError(
            f"job {run_id} completed without its tier models ({TIER_MODELS}); resume it "
            "(`fedge aggregator resume --dir`) to write them"
        )
    return run_id, examples


def _export(job_dir: Path, arch: str) -> tuple[Path, Path, ModelSpec]:
    """``arch``'s final model as ONNX (checked against torch) and trainable weights."""
    from fedge.models.inspection import export_onnx

    spec = ModelSpec.from_json((job_dir / MODEL_SPEC).read_text(encoding="utf-8"))
    if spec.preprocess.channels != 1:
        raise JobError("exporting multi-channel families is not supported yet")
    spec = families.round_spec(spec, arch)
    final = read_tier_models(job_dir).arrays(job_dir, arch)
    model = families.build(spec.family, spec.params, len(spec.classes))
    families.load_state_arrays(model, final)
    onnx_path = job_dir / f"final-{arch}.onnx"
    export_onnx(model, onnx_path, image_size=spec.preprocess.image_size)
    weights_path = job_dir / f"final-{arch}-weights.npz"
    weights_path.write_bytes(families.weights_bytes(final))
    return onnx_path, weights_path, spec


def _publish(
    home: ManagerHome,
    manifest: FleetJobManifest,
    run_id: str,
    stations: dict[str, tuple[str, ...]],
    exported: dict[str, tuple[Path, Path, ModelSpec]],
    examples: dict[str, int],
) -> dict[str, str]:
    """Each architecture's model in the registry: arch -> its ref."""
    parent_name, parent_version = parse_ref(manifest.task.model)
    refs: dict[str, str] = {}
    with ManagerView(home) as (fleet, registry):
        fleet.edges([edge for edges in stations.values() for edge in edges])  # still enrolled
        parent = registry.get(parent_name, parent_version)
        listed = registry.list()
        for arch, (onnx_path, weights_path, spec) in exported.items():
            name = tier_name(manifest.publish_name, arch)
            found = next((m for m in listed if m.name == name and m.run_id == run_id), None)
            if found is not None:  # published, then killed before it was noted
                refs[arch] = found.ref
                continue
            counts = ",".join(f"{edge}={examples.get(edge, 0)}" for edge in stations[arch])
            published = registry.publish(
                onnx_path,
                name=name,
                version=(registry.latest_version(name) or 0) + 1,
                classes=spec.classes,
                positive_classes=parent.manifest.positive_classes,
                lineage=Lineage(
                    parent_version=None,
                    run_id=run_id,
                    data=f"fleet {manifest.federation.fleet} tier {arch}: examples {counts}"[:1000],
                    note=(
                        f"{manifest.kind} job {manifest.name}: {arch} for "
                        f"{', '.join(stations[arch])}, {_HOW[manifest.kind]} from "
                        f"{manifest.task.model}"
                    ),
                ),
                preprocess=spec.preprocess,
                trainable=TrainableSource(weights_path, spec.family, dict(spec.params)),
            )
            refs[arch] = published.manifest.ref
    return refs

"""Publishing a completed fleet job: ONNX export (checked against torch) and lineage, once.

An anomaly job's model is the fleet's fit behind the task model's feature layers
(:mod:`.anomaly`), published under ``<model>-anomaly`` without trainable weights: a later
job fits it again from the stations' statistics, never from these weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from fedge.aggregator.anomaly.rounds import read_thresholds
from fedge.aggregator.fleet.manifest import load_fleet_manifest
from fedge.aggregator.fleet.server import INITIAL_WEIGHTS, MODEL_SPEC
from fedge.aggregator.jobs.checkpoint import atomic_write_text, load_arrays
from fedge.aggregator.jobs.directory import (
    FINAL_MODEL,
    JOB_MANIFEST,
    RUNS_DB,
    JobError,
    job_lock,
)
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.registry.recommendations import write_anomaly_thresholds
from fedge.edge_manager.registry.versions import TrainableSource, parse_ref
from fedge.edge_manager.scheduler import owned_models
from fedge.federation.anomaly import ANOMALY_CLASSES, export_anomaly
from fedge.federation.prepare import ManagerView
from fedge.federation.tier_publish import is_tier_job, publish_tiers
from fedge.party import families
from fedge.protocols.manifest import Lineage
from fedge.protocols.model_spec import ModelSpec

PUBLISHED = "published.json"


def published_ref(job_dir: Path) -> str | None:
    try:
        return str(json.loads((job_dir / PUBLISHED).read_text())["ref"])
    except (OSError, ValueError, KeyError):
        return None


def publish(job_dir: Path, home: ManagerHome) -> str:
    """Export the completed job's model to ONNX and publish it with lineage, once.

    Under the job's lock, so two ``resume`` calls cannot both publish; and a version
    already in the registry from this run (published, then killed before it was noted
    here) is found by its lineage instead of being published again.
    """
    with job_lock(job_dir, wait_s=60.0):
        if is_tier_job(job_dir):  # one model per tier, each deployed to its stations
            return publish_tiers(job_dir, home)
        return _publish_once(job_dir, home)


def _publish_once(job_dir: Path, home: ManagerHome) -> str:
    done = published_ref(job_dir)
    if done is not None:
        return done
    from fedge.models.inspection import export_onnx

    manifest = load_fleet_manifest(job_dir / JOB_MANIFEST)
    spec = ModelSpec.from_json((job_dir / MODEL_SPEC).read_text(encoding="utf-8"))
    store = RunStore(job_dir / RUNS_DB)
    try:
        run_id = str(store.runs()[-1]["run_id"])
        if store.runs()[-1]["state"] != RunState.COMPLETED:
            raise JobError(f"job {run_id} has not completed; nothing to publish")
        names = store.party_names(run_id)
        examples: dict[str, int] = {}
        for row in store.party_metrics(run_id):
            name = names.get(int(row["party"]), str(row["party"]))
            examples[name] = int(row["metrics"].get("num-examples", 0))
        if not examples:
            # The ServerApp fails such a job; a run store from before that rule says
            # "completed" for it all the same: a model no station trained is not new.
            raise JobError(f"no station trained in job {run_id}; nothing to publish")
        rounds = len(store.rounds(run_id))
    finally:
        store.close()
    if spec.preprocess.channels != 1:
        raise JobError("exporting multi-channel families is not supported yet")
    classes, positive, trainable = spec.classes, None, None
    if manifest.anomaly is not None:  # the fit behind the task model's feature layers
        onnx_path, parts = export_anomaly(
            job_dir, spec, manifest.anomaly, job_dir / INITIAL_WEIGHTS, job_dir / FINAL_MODEL
        )
        classes, positive = ANOMALY_CLASSES, ANOMALY_CLASSES[1:]
        what = f"an anomaly model fitted on {parts} good parts"
    else:
        model = families.build(spec.family, spec.params, len(spec.classes))
        final = load_arrays(job_dir / FINAL_MODEL)
        families.load_state_arrays(model, final)
        onnx_path = job_dir / "final.onnx"
        export_onnx(model, onnx_path, image_size=spec.preprocess.image_size)
        weights_path = job_dir / "final-weights.npz"
        weights_path.write_bytes(families.weights_bytes(final))
        trainable = TrainableSource(weights_path, spec.family, dict(spec.params))
        what = f"{rounds} rounds of {manifest.kind}"
    parent_name, parent_version = parse_ref(manifest.task.model)
    view = ManagerView(home)
    with view as (_, registry):
        for listed in registry.list():
            if listed.name == manifest.publish_name and listed.run_id == run_id:
                owned_models.own_published(
                    view.store, job_dir, listed.name, listed.version, time.time()
                )
                atomic_write_text(
                    job_dir / PUBLISHED, json.dumps({"ref": listed.ref, "at": time.time()})
                )
                return listed.ref
        parent = registry.get(parent_name, parent_version)
        version = (registry.latest_version(manifest.publish_name) or 0) + 1
        counts = ",".join(f"{edge}={n}" for edge, n in sorted(examples.items()))
        published = registry.publish(
            onnx_path,
            name=manifest.publish_name,
            version=version,
            classes=classes,
            positive_classes=parent.manifest.positive_classes if positive is None else positive,
            lineage=Lineage(
                parent_version=parent_version if parent_name == manifest.publish_name else None,
                run_id=run_id,
                data=f"fleet {manifest.federation.fleet}: examples {counts}"[:1000],
                note=f"federated job {manifest.name}: {what} from {manifest.task.model}",
            ),
            preprocess=spec.preprocess,
            trainable=trainable,
        )
        # A team's queued job publishes the team's model (issue 31 item 4).
        owned_models.own_published(
            view.store, job_dir, published.manifest.name, version, time.time()
        )
    ref = published.manifest.ref
    if manifest.anomaly is not None:
        # Each station's own threshold, kept with the version it was measured on: the
        # operator pushes it with `fedge edge set-threshold EDGE --anomaly recommended`.
        write_anomaly_thresholds(
            home.artifacts, published.manifest.name, version, read_thresholds(job_dir)
        )
    atomic_write_text(job_dir / PUBLISHED, json.dumps({"ref": ref, "at": time.time()}))
    return ref

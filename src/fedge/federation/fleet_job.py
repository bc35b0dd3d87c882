"""Federated jobs across the fleet: prepare, submit to the SuperLink, wait, publish.

``fedge aggregator run job.toml`` with ``[federation] backend = "fleet"`` comes here:

1. **prepare** -- the manifest is checked against the manager's store before anything
   is written: the fleet is this home's, every named edge is enrolled and has training
   enabled in its desired config, the model is in the registry with trainable weights
   that match its signed manifest and build with their family. Then the job directory
   gets the manifest, the model spec the stations build, the starting weights, the
   edge -> party map, a queued run in its run store, and the Flower app to submit.
2. **submit** -- ``flwr run`` sends the app to the fleet's SuperLink, which starts
   fedge's ServerApp (:mod:`fedge.aggregator.fleet_server`) in a process of its own.
3. **wait** -- the run store shows the rounds as they end; a ServerApp that died
   (its job lock free while the run says running) is reported, and ``resume`` submits
   the job again to continue from its newest checkpoint.
4. **publish** -- the final weights are exported to ONNX (checked against torch with
   ONNX Runtime) and published with their lineage: the job, its rounds, the parties and
   their example counts, the parent version. Publishing is recorded in the job
   directory, so it happens once however often ``resume`` runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.aggregator.checkpoint import atomic_write_text, load_arrays
from fedge.aggregator.fleet_manifest import FleetJobManifest, load_fleet_manifest
from fedge.aggregator.fleet_server import INITIAL_WEIGHTS, MODEL_SPEC, PARTIES
from fedge.aggregator.grids import NODE_ID_BASE
from fedge.aggregator.job_dir import (
    FINAL_MODEL,
    JOB_MANIFEST,
    RUNS_DB,
    JobError,
    is_live,
    job_lock,
)
from fedge.aggregator.job_spec import ManifestError
from fedge.aggregator.run_store import RunState, RunStore
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import Fleet
from fedge.edge_manager.home import ManagerHome
from fedge.edge_manager.registry import PublishedModel, Registry, TrainableSource, parse_ref
from fedge.party import families
from fedge.party.errors import FamilyError
from fedge.protocols.manifest import Lineage
from fedge.protocols.model_spec import ModelSpec

APP_DIR = "app"
PUBLISHED = "published.json"
SUBMITTED = "submitted.json"
CONNECTION = "fedge-fleet"
# A submitted run's ServerApp must take the job lock within this (Flower starts it through
# SuperExec, which polls; a busy host is slow): past it, a run nobody holds is dead.
DEAD_GRACE_S = 120.0

ProgressFn = Callable[[int, int, float | None], None]


@dataclass(frozen=True)
class FleetJobResult:
    run_id: str
    state: RunState
    rounds: int
    last_round: int
    published: str | None  # the new model's ref, once published
    error: str = ""


# ---------------------------------------------------------------- prepare


def prepare(manifest_path: Path, job_dir: Path, home: ManagerHome) -> FleetJobManifest:
    """Validate a fleet job against the manager's store, then write its job directory."""
    manifest = load_fleet_manifest(manifest_path)
    if (job_dir / RUNS_DB).exists():
        raise JobError(
            f"{job_dir} already holds a job; resume it (`fedge aggregator resume --dir "
            f"{job_dir}`) or choose another --dir"
        )
    with _open(home) as (fleet, registry):
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
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / INITIAL_WEIGHTS).write_bytes(weights)
    atomic_write_text(job_dir / MODEL_SPEC, spec.to_json())
    parties = {edge: NODE_ID_BASE + index for index, edge in enumerate(sorted(edges))}
    atomic_write_text(job_dir / PARTIES, json.dumps(parties, indent=1))
    atomic_write_text(job_dir / JOB_MANIFEST, manifest.text)
    _write_app(job_dir)
    store = RunStore(job_dir / RUNS_DB)
    try:
        store.create_run(f"{manifest.name}-{uuid.uuid4().hex[:8]}", manifest.text, RunState.QUEUED)
    finally:
        store.close()
    return manifest


class _open:
    """The manager's store, fleet and registry for the length of a block."""

    def __init__(self, home: ManagerHome) -> None:
        from fedge.edge_manager.store import Store

        settings = home.settings()
        self.store = Store(home.db_path)
        key = home.signing_key()
        self.registry = Registry(self.store, home.artifacts, key)
        self.fleet = Fleet(self.store, settings.fleet, key, self.registry, settings.grpc_target)

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


def _write_app(job_dir: Path) -> None:
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
                'serverapp = "fedge.aggregator.fleet_server:app"',
                'clientapp = "fedge.party.station_app:app"',
                "",
                "[tool.flwr.app.config]",
                f"job-dir = {json.dumps(str(job_dir.resolve()))}",
                "",
            ]
        ),
    )


# ---------------------------------------------------------------- submit and wait


def submit(job_dir: Path, superlink: str) -> dict[str, Any]:
    """Send the job's app to the SuperLink with ``flwr run``; returns Flower's answer.

    The run is marked queued first: until the new ServerApp takes the job, what the run
    store says (halted, failed) is about the previous submission.
    """
    _mark_queued(job_dir)
    cli_home = job_dir / "flwr-cli"
    cli_home.mkdir(exist_ok=True)
    (cli_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "{superlink}"\ninsecure = true\n',
        encoding="utf-8",
    )
    flwr = Path(sys.executable).parent / "flwr"
    if not flwr.exists():
        found = shutil.which("flwr")
        if found is None:
            raise JobError("the `flwr` command is not installed (pip install 'fedge[train]')")
        flwr = Path(found)
    env = {**os.environ, "FLWR_HOME": str(cli_home), "FLWR_TELEMETRY_ENABLED": "0"}
    try:
        result = subprocess.run(
            [str(flwr), "run", str(job_dir / APP_DIR), CONNECTION, "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise JobError(f"`flwr run` did not answer within 180 s (SuperLink {superlink})") from None
    text = result.stdout
    answer: dict[str, Any] = {}
    if "{" in text:
        try:
            answer = json.loads(text[text.index("{") :])
        except json.JSONDecodeError:
            answer = {}
    if result.returncode != 0 or not answer.get("success"):
        detail = (answer.get("error-message") or result.stderr or text).strip()[-800:]
        raise JobError(f"the SuperLink at {superlink} refused the job: {detail}")
    answer["submitted_at"] = time.time()
    atomic_write_text(job_dir / SUBMITTED, json.dumps(answer))
    return answer


def _mark_queued(job_dir: Path) -> None:
    """A (re)submitted job is queued again until its new ServerApp takes it."""
    store = RunStore(job_dir / RUNS_DB)
    try:
        run = store.runs()[-1]
        if RunState(run["state"]) is not RunState.COMPLETED:
            store.set_state(str(run["run_id"]), RunState.QUEUED, error="")
    finally:
        store.close()


def wait(
    job_dir: Path,
    *,
    progress: ProgressFn | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
) -> FleetJobResult:
    """Follow the run store until the job ends, halts, fails or its aggregator dies."""
    manifest = load_fleet_manifest(job_dir / JOB_MANIFEST)
    total = manifest.job.rounds
    submitted = _submitted_at(job_dir)
    end = None if timeout_s is None else time.monotonic() + timeout_s
    reported = -1
    seen_live = False
    while True:
        store = RunStore(job_dir / RUNS_DB)
        try:
            runs = store.runs()
            run = runs[-1]
            rounds = store.rounds(str(run["run_id"]))
        finally:
            store.close()
        state = RunState(run["state"])
        last = int(run["last_round"])
        settled = float(run["updated_at"]) >= submitted  # not the state of an older submission
        if progress is not None and last != reported:
            accuracy = rounds[-1]["eval_metrics"].get("accuracy") if rounds else None
            progress(last, total, None if accuracy is None else float(accuracy))
            reported = last
        if state is RunState.COMPLETED or (state in (RunState.FAILED, RunState.HALTED) and settled):
            return FleetJobResult(str(run["run_id"]), state, total, last, None, str(run["error"]))
        live = is_live(job_dir)
        seen_live = seen_live or live
        if not live and (seen_live or time.time() - submitted > DEAD_GRACE_S):
            # The lock is free: the ServerApp ended. Read once more what it left: an end
            # written just before it let go is an end, anything else is a death.
            final = _latest_run(job_dir)
            final_state = RunState(final["state"])
            if final_state is RunState.COMPLETED or (
                final_state in (RunState.FAILED, RunState.HALTED)
                and float(final["updated_at"]) >= submitted
            ):
                return FleetJobResult(
                    str(final["run_id"]), final_state, total, int(final["last_round"]), None,
                    str(final["error"]),
                )  # fmt: skip
            return FleetJobResult(
                str(run["run_id"]),
                state,
                total,
                last,
                None,
                "the aggregator (ServerApp) is not running: it was killed or its SuperLink "
                "stopped; `fedge aggregator resume --dir` continues from the last checkpoint",
            )
        if end is not None and time.monotonic() >= end:
            raise JobError(f"job in {job_dir} did not end within {timeout_s:.0f}s")
        time.sleep(poll_s)


def _latest_run(job_dir: Path) -> dict[str, Any]:
    store = RunStore(job_dir / RUNS_DB)
    try:
        return store.runs()[-1]
    finally:
        store.close()


def _submitted_at(job_dir: Path) -> float:
    try:
        return float(json.loads((job_dir / SUBMITTED).read_text())["submitted_at"])
    except (OSError, ValueError, KeyError):
        return 0.0


def needs_submission(job_dir: Path) -> bool:
    """Whether resuming must submit the job again (no aggregator is running it)."""
    store = RunStore(job_dir / RUNS_DB)
    try:
        state = RunState(store.runs()[-1]["state"])
    finally:
        store.close()
    return state is not RunState.COMPLETED and not is_live(job_dir)


# ---------------------------------------------------------------- publish


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
        rounds = len(store.rounds(run_id))
    finally:
        store.close()
    if spec.preprocess.channels != 1:
        raise JobError("exporting multi-channel families is not supported yet")
    model = families.build(spec.family, spec.params, len(spec.classes))
    final = load_arrays(job_dir / FINAL_MODEL)
    families.load_state_arrays(model, final)
    onnx_path = job_dir / "final.onnx"
    export_onnx(model, onnx_path, image_size=spec.preprocess.image_size)
    weights_path = job_dir / "final-weights.npz"
    weights_path.write_bytes(families.weights_bytes(final))
    parent_name, parent_version = parse_ref(manifest.task.model)
    with _open(home) as (_, registry):
        for row in registry.list():
            if row["name"] == manifest.publish_name and row["run_id"] == run_id:
                ref = f"{row['name']}:{row['version']}"
                atomic_write_text(job_dir / PUBLISHED, json.dumps({"ref": ref, "at": time.time()}))
                return ref
        parent = registry.get(parent_name, parent_version)
        version = (registry.latest_version(manifest.publish_name) or 0) + 1
        counts = ",".join(f"{edge}={n}" for edge, n in sorted(examples.items()))
        published = registry.publish(
            onnx_path,
            name=manifest.publish_name,
            version=version,
            classes=spec.classes,
            positive_classes=parent.manifest.positive_classes,
            lineage=Lineage(
                parent_version=parent_version if parent_name == manifest.publish_name else None,
                run_id=run_id,
                data=f"fleet {manifest.federation.fleet}: examples {counts}"[:1000],
                note=(
                    f"federated job {manifest.name}: {rounds} rounds of {manifest.kind} from "
                    f"{manifest.task.model}"
                ),
            ),
            preprocess=spec.preprocess,
            trainable=TrainableSource(weights_path, spec.family, dict(spec.params)),
        )
    ref = published.manifest.ref
    atomic_write_text(job_dir / PUBLISHED, json.dumps({"ref": ref, "at": time.time()}))
    return ref


# ---------------------------------------------------------------- the whole job


def is_fleet_job(job_dir: Path) -> bool:
    from fedge.aggregator.fleet_manifest import is_fleet_manifest

    path = job_dir / JOB_MANIFEST
    return path.is_file() and is_fleet_manifest(path.read_text(encoding="utf-8"))


def run_fleet_job(
    manifest_path: Path,
    job_dir: Path,
    home: ManagerHome,
    *,
    progress: ProgressFn | None = None,
    timeout_s: float | None = None,
) -> FleetJobResult:
    """Prepare, submit, follow and publish a fleet job (``fedge aggregator run``)."""
    prepare(manifest_path, job_dir, home)
    submit(job_dir, home.settings().superlink_address)
    return _finish(job_dir, home, progress, timeout_s)


def resume_fleet_job(
    job_dir: Path,
    home: ManagerHome,
    *,
    progress: ProgressFn | None = None,
    timeout_s: float | None = None,
) -> FleetJobResult:
    """Continue a fleet job: submit it again if no aggregator runs it, follow, publish."""
    if needs_submission(job_dir):
        _clear_halt(job_dir)  # resuming is the newer request
        submit(job_dir, home.settings().superlink_address)
    return _finish(job_dir, home, progress, timeout_s)


def _clear_halt(job_dir: Path) -> None:
    from fedge.aggregator.job_dir import clear_halt

    clear_halt(job_dir)


def _finish(
    job_dir: Path, home: ManagerHome, progress: ProgressFn | None, timeout_s: float | None
) -> FleetJobResult:
    result = wait(job_dir, progress=progress, timeout_s=timeout_s)
    if result.state is RunState.COMPLETED:
        ref = publish(job_dir, home)
        return FleetJobResult(
            result.run_id, result.state, result.rounds, result.last_round, ref, result.error
        )
    return result

"""A sweep run (issue 31 item 5; Katib-style): Optuna proposes settings, each trial is a
simulated job queued as a best-effort (BE) job on the scheduler, and the ranked report
and the best setting as a fleet job manifest are written at the end.

The queue is the manager's own job queue (edge_manager/scheduler: its store, its checks,
its decide()) in the sweep's directory (``queue.db``), with ``parallel`` simulation
slots as its stations, so a trial waits, is placed, runs and ends as a fleet job does,
every change in its audit log. Trials placed together run one after the other in this
process. Optuna's TPE sampler (Bergstra et al., NeurIPS 2011) asks for a setting and is
told the trial's final test accuracy (a failed trial is told it failed).

The sweep directory::

    <out>/queue.db                  the scheduler's queue (a manager store)
    <out>/trials/<name>-tNNN.toml   each trial's manifest
    <out>/trials/<name>-tNNN/       each trial's job directory (fedge aggregator status)
    <out>/sweep.json                the ranked trials and the best
    <out>/best-fleet-job.toml       the best setting, for fedge jobs submit --manifest
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedge.aggregator.jobs.directory import JobError
from fedge.aggregator.jobs.spec import ManifestError
from fedge.edge_manager.scheduler import service
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.lifecycle import JobState
from fedge.edge_manager.scheduler.policy import Policy
from fedge.edge_manager.scheduler.queue import Station
from fedge.edge_manager.store import Store
from fedge.sim.jobs import run_job
from fedge.sim.sweep.manifests import base_document, fleet_text, trial_text
from fedge.sim.sweep.spec import Choices, Range, SweepError, SweepSpec

QUEUE_DB = "queue.db"
REPORT = "sweep.json"
BEST_MANIFEST = "best-fleet-job.toml"
WHO = "sweep"  # the audit log's "who" for the trials the sweep submits


@dataclass(frozen=True)
class TrialResult:
    trial: int
    job_id: str
    params: dict[str, float]
    state: str  # completed | failed
    accuracy: float | None
    job_dir: str
    error: str = ""


@dataclass(frozen=True)
class SweepReport:
    name: str
    ranked: list[TrialResult]
    best: TrialResult | None
    fleet_manifest: str  # '' when no trial completed

    def to_json(self) -> dict[str, Any]:
        return {
            "sweep": self.name,
            "trials": [{"rank": i + 1, **asdict(t)} for i, t in enumerate(self.ranked)],
            "best": None if self.best is None else asdict(self.best),
            "fleet_manifest": self.fleet_manifest,
        }


def run_sweep(
    spec: SweepSpec,
    out: Path,
    *,
    on_trial: Callable[[TrialResult], None] | None = None,
) -> SweepReport:
    """Run ``spec``'s trials in ``out`` (which must not hold a sweep); everything in the
    spec is checked, and one trial's manifest built, before anything is queued."""
    import optuna  # the training side only (pip install 'fedge[train]')

    manifest, document = base_document(spec)
    low = {k: _lowest(v) for k, v in spec.space.items()}
    trial_text(spec, document, f"{spec.name}-check", low)  # a bad combination fails now
    if (out / QUEUE_DB).exists():
        raise SweepError(f"{out} already holds a sweep; choose another --out")
    (out / "trials").mkdir(parents=True, exist_ok=True)
    store = Store(out / QUEUE_DB)
    try:
        service.add_team(store, spec.team, None, who=WHO, now=time.time())
        slots = [f"sim-slot-{i + 1}" for i in range(spec.parallel)]
        stations = [Station(s) for s in slots]
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            direction="maximize", sampler=optuna.samplers.TPESampler(seed=spec.seed)
        )
        results: list[TrialResult] = []
        while len(results) < spec.trials:
            asked = []
            for _ in range(min(spec.parallel, spec.trials - len(results))):
                trial = study.ask()
                params = {k: _suggest(trial, k, v) for k, v in spec.space.items()}
                job_id = f"{spec.name}-t{trial.number:03d}"
                path = out / "trials" / f"{job_id}.toml"
                path.write_text(trial_text(spec, document, job_id, params), encoding="utf-8")
                service.submit_job(
                    store, kind="be", team=spec.team, stations="any 1", grace_s=60.0,
                    max_preemptions=1, priority=0, job_dir=str(out / "trials" / job_id),
                    who=WHO, now=time.time(), job_id=job_id, enrolled=slots,
                )  # fmt: skip
                asked.append((trial, job_id, path, params))
            placed = service.tick(store, Policy(), stations, time.time()).start
            by_id = {job_id: (trial, path, params) for trial, job_id, path, params in asked}
            for placement in placed:
                trial, path, params = by_id[placement.job_id]
                result = _run_trial(store, trial.number, placement.job_id, path, params)
                if result.accuracy is None:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                else:
                    study.tell(trial, result.accuracy)
                results.append(result)
                if on_trial is not None:
                    on_trial(result)
            if not placed:
                raise SweepError("the sweep's queue placed no trial; see queue.db's events")
    finally:
        store.close()
    return _report(spec, manifest, results, out)


def _run_trial(
    store: Store, number: int, job_id: str, manifest: Path, params: dict[str, float]
) -> TrialResult:
    job_dir = Path(queue_store.job(store, job_id).job_dir)
    try:
        result = run_job(manifest, job_dir)
    except (JobError, ManifestError) as exc:
        queue_store.transition(
            store, job_id, JobState.FAILED, who=service.SCHEDULER, at=time.time(), detail=str(exc)
        )
        return TrialResult(number, job_id, params, "failed", None, str(job_dir), str(exc))
    detail = "completed" if result.accuracy is None else f"accuracy {result.accuracy:.4f}"
    queue_store.transition(
        store, job_id, JobState.COMPLETED, who=service.SCHEDULER, at=time.time(), detail=detail
    )
    return TrialResult(number, job_id, params, "completed", result.accuracy, str(job_dir))


def _report(spec: SweepSpec, manifest: Any, results: list[TrialResult], out: Path) -> SweepReport:
    ranked = sorted(results, key=lambda r: (r.accuracy is None, -(r.accuracy or 0.0), r.trial))
    best = ranked[0] if ranked and ranked[0].accuracy is not None else None
    fleet_manifest = ""
    if best is not None:
        path = out / BEST_MANIFEST
        path.write_text(
            f"# The best of sweep {spec.name}: trial {best.trial}, accuracy "
            f"{best.accuracy:.4f} on the simulated fleet.\n# Queue it with: fedge jobs submit "
            f"--manifest {path} --job-dir JOB_DIR --kind be --team TEAM\n"
            + fleet_text(spec, manifest, best.params),
            encoding="utf-8",
        )
        fleet_manifest = str(path)
    report = SweepReport(spec.name, ranked, best, fleet_manifest)
    (out / REPORT).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return report


def _lowest(space: Range | Choices) -> float:
    if isinstance(space, Choices):
        return space.values[0]
    return int(space.low) if space.integer else space.low


def _suggest(trial: Any, key: str, space: Range | Choices) -> float:
    if isinstance(space, Choices):
        value: float = trial.suggest_categorical(key, list(space.values))
        return value
    if space.integer:
        return int(trial.suggest_int(key, int(space.low), int(space.high), log=space.log))
    return float(trial.suggest_float(key, space.low, space.high, log=space.log))

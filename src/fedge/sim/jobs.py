"""Managed simulated federated jobs: run, checkpoint, halt and resume (FfDL-style).

A job is a manifest (:mod:`fedge.sim.job_manifest`) run in a job directory::

    <job_dir>/
        job.toml              the manifest, as submitted
        scenario.toml         a frozen copy of its scenario (the parties read this one)
        runs.db               the run store: the run's state and every round
        checkpoints/          round-NNNNNN.npz, atomic (fedge.aggregator.jobs.checkpoint)
        final.npz             the final model's arrays, once completed
        halt-request          present while a halt is requested
        .lock                 flock'd by the process running the job

The run goes ``queued -> running -> completed`` (or ``failed`` with the error, or
``halted`` on a halt request, seen between rounds; its checkpoint is kept). Every round
is recorded as it ends and checkpointed (``[checkpoint] every``, and always at the last
round and on a halt). That life is the aggregator's job runner
(:mod:`fedge.aggregator.jobs.runner`), shared with fleet jobs; this module gives it the
simulated fleet of the job's frozen scenario, its test set and its starting model.
:func:`resume_job` continues a halted, failed or killed job from its
newest checkpoint: the model, the strategy's state (RNG, latency profiles, tiers, tier
selection, the virtual clock) and late replies held for staleness folding. The parties'
randomness is a pure function of (seed, partition, round), so a job SIGKILLed mid-way and
resumed ends with the same final model as one that ran straight through.

Only one process runs a job at a time: it holds ``.lock`` (``flock``), which the kernel
releases when the process dies however it dies, so "running" in the store plus a free
lock means the runner was killed and the job can be resumed.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedge.aggregator.jobs.checkpoint import atomic_write_text
from fedge.aggregator.jobs.control import require_job, the_run
from fedge.aggregator.jobs.directory import (
    JOB_MANIFEST,
    JOB_SCENARIO,
    LEDGERS,
    RUNS_DB,
    JobError,
    clear_halt,
    job_lock,
)
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.jobs.runner import JobResult, JobRounds, JobRun, ProgressFn, execute_job
from fedge.aggregator.jobs.spec import ManifestError
from fedge.sim.job_manifest import JobManifest, load_manifest, parse_manifest

# ---------------------------------------------------------------- public API


def run_job(
    manifest_path: Path | str, job_dir: Path | str, *, progress: ProgressFn | None = None
) -> JobResult:
    """Validate a manifest, then run it as a new job in ``job_dir`` (until done or halted).

    The manifest is validated completely before anything is created; a job directory
    that already holds a job is refused (resume it instead).
    """
    manifest = load_manifest(manifest_path)
    if manifest.federation.backend != "inprocess":
        raise ManifestError(
            f"federation.backend: {manifest.federation.backend!r} jobs are not run here "
            "(`fedge aggregator run` runs 'inprocess' jobs)"
        )
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    with job_lock(job_dir):
        if (job_dir / RUNS_DB).exists():  # (a job.toml alone is a start that never began)
            raise JobError(
                f"{job_dir} already holds a job; resume it (`fedge aggregator resume --dir "
                f"{job_dir}`) or choose another --dir"
            )
        atomic_write_text(job_dir / JOB_MANIFEST, manifest.text)
        atomic_write_text(
            job_dir / JOB_SCENARIO, manifest.task.scenario_file.read_text(encoding="utf-8")
        )
        clear_halt(job_dir)
        run_id = f"{manifest.name}-{uuid.uuid4().hex[:8]}"
        store = RunStore(job_dir / RUNS_DB)
        try:
            store.create_run(run_id, manifest.text, RunState.QUEUED)
            return _execute(_frozen_manifest(job_dir), job_dir, store, run_id, progress)
        finally:
            store.close()


def resume_job(job_dir: Path | str, *, progress: ProgressFn | None = None) -> JobResult:
    """Continue a halted, failed or killed job from its newest checkpoint.

    Any pending halt request is withdrawn first: resuming is the newer request.
    """
    job_dir = Path(job_dir)
    require_job(job_dir)
    with job_lock(job_dir):
        store = RunStore(job_dir / RUNS_DB)
        try:
            run = the_run(store, job_dir)
            run_id = str(run["run_id"])
            if run["state"] == RunState.COMPLETED:
                raise JobError(f"job {run_id} already completed; there is nothing to resume")
            manifest = _frozen_manifest(job_dir)
            clear_halt(job_dir)
            return _execute(manifest, job_dir, store, run_id, progress)
        finally:
            store.close()


# ---------------------------------------------------------------- running


def _execute(
    manifest: JobManifest,
    job_dir: Path,
    store: RunStore,
    run_id: str,
    progress: ProgressFn | None,
) -> JobResult:
    run = JobRun(
        job_dir=job_dir,
        store=store,
        run_id=run_id,
        rounds=manifest.rounds,
        checkpoint=manifest.checkpoint,
        resume_state=_resume_state(manifest, job_dir, run_id),
    )
    return execute_job(run, lambda: _rounds(manifest, job_dir), progress=progress)


def _rounds(manifest: JobManifest, job_dir: Path) -> JobRounds:
    """The simulated fleet of the job's frozen scenario, its strategy and its test set."""
    # The training stack (torch, the simulated fleet) is only needed here.
    from flwr.app import ArrayRecord
    from flwr.serverapp import Grid

    from fedge.aggregator.rounds.clock import ClockMode
    from fedge.aggregator.strategies.factory import build_strategy
    from fedge.models import digits
    from fedge.sim.data import make_partitions
    from fedge.sim.grid import InProcessGrid
    from fedge.sim.party_app import app as client_app
    from fedge.sim.party_inputs import PRIVACY_DIR_KEY
    from fedge.sim.runner import evaluator, train_config

    scenario = manifest.scenario
    data = make_partitions(scenario, manifest.seed)
    strategy, extra = build_strategy(
        manifest.strategy.kind,
        manifest.strategy_params(),
        per_round=scenario.fleet.per_round,
        seed=manifest.seed,
        clock=ClockMode.VIRTUAL,
        proxy_X=data.proxy_X,
    )
    # distill trains one model per tier architecture; the global one is the largest.
    arch = str(extra.get("arch", manifest.task.arch))

    def initial_arrays() -> ArrayRecord:
        return digits.to_arrays(digits.make_model(arch, seed=manifest.seed))

    @contextmanager
    def open_grid() -> Iterator[Grid]:
        # The parties' DP ledgers live in the job directory: a resumed job's parties
        # remember what they spent.
        grid = InProcessGrid(
            client_app,
            scenario.fleet.parties,
            run_config={
                "scenario": str(job_dir.resolve() / JOB_SCENARIO),
                "seed": manifest.seed,
                PRIVACY_DIR_KEY: str(job_dir.resolve() / LEDGERS),
            },
            workers=manifest.federation.workers,
        )
        try:
            yield grid
        finally:
            grid.close()

    return JobRounds(
        strategy=strategy,
        initial_arrays=initial_arrays,
        open_grid=open_grid,
        evaluation=lambda _grid: evaluator(scenario, data, arch=arch),
        train_config=train_config(scenario, extra),
        round_timeout_s=600,
        # SecAgg+'s max_weight: no simulated party reports more examples than this.
        max_weight=float(max(data.party_size(p) for p in range(data.num_parties))),
    )


def _resume_state(manifest: JobManifest, job_dir: Path, run_id: str) -> dict[str, Any]:
    """What besides the strategy a resumed job must agree with to continue identically."""
    return {
        "run_id": run_id,
        "seed": manifest.seed,
        "rounds": manifest.rounds,
        "arch": manifest.task.arch,
        "strategy": manifest.strategy.kind,
        "parties": manifest.scenario.fleet.parties,
        "scenario_sha256": _sha256(job_dir / JOB_SCENARIO),
    }


# ---------------------------------------------------------------- the job directory


def _frozen_manifest(job_dir: Path) -> JobManifest:
    """The job's manifest as submitted, read against its frozen scenario copy."""
    path = job_dir / JOB_MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise JobError(f"{job_dir} has no readable {JOB_MANIFEST}: {exc}") from exc
    return parse_manifest(
        text, source=str(path), base_dir=job_dir, scenario_file=job_dir / JOB_SCENARIO
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()

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
round and on a halt). :func:`resume_job` continues a halted, failed or killed job from its
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.aggregator.jobs.checkpoint import (
    Checkpoint,
    atomic_write_text,
    checkpoint_round,
    latest_checkpoint,
    restore_strategy,
    save_arrays,
)
from fedge.aggregator.jobs.control import ACCURACY_KEY, require_job, the_run
from fedge.aggregator.jobs.directory import (
    FINAL_MODEL,
    JOB_MANIFEST,
    JOB_SCENARIO,
    LEDGERS,
    RUNS_DB,
    JobError,
    clear_halt,
    halt_requested,
    job_lock,
)
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.jobs.spec import ManifestError
from fedge.aggregator.rounds.record import RoundRecord
from fedge.sim.job_manifest import JobManifest, load_manifest, parse_manifest

ProgressFn = Callable[[int, int, float | None], None]
"""Called with (rounds done, total rounds, test accuracy) at the start and after each round."""


@dataclass(frozen=True)
class JobResult:
    """How a :func:`run_job` / :func:`resume_job` call ended."""

    run_id: str
    job_dir: Path
    state: RunState  # completed or halted (a failure raises JobError)
    last_round: int
    rounds: int
    accuracy: float | None  # test accuracy after last_round
    final_model: Path | None  # <job_dir>/final.npz once completed
    resumed_from: int  # the checkpoint's round (0: started from scratch)


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
            return _execute(_frozen_manifest(job_dir), job_dir, store, run_id, None, progress)
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
            checkpoint = latest_checkpoint(job_dir)
            if checkpoint is not None:
                _check_compatible(checkpoint, manifest, job_dir, run_id)
            return _execute(manifest, job_dir, store, run_id, checkpoint, progress)
        finally:
            store.close()


# ---------------------------------------------------------------- running


class _Halted(Exception):
    def __init__(self, server_round: int) -> None:
        super().__init__(f"halted after round {server_round}")
        self.server_round = server_round


def _execute(
    manifest: JobManifest,
    job_dir: Path,
    store: RunStore,
    run_id: str,
    checkpoint: Checkpoint | None,
    progress: ProgressFn | None,
) -> JobResult:
    resumed_from = 0 if checkpoint is None else checkpoint.round
    store.set_state(run_id, RunState.RUNNING)
    last = {"round": resumed_from, "accuracy": _recorded_accuracy(store, run_id, resumed_from)}
    try:
        _train(manifest, job_dir, store, run_id, checkpoint, progress, last)
    except _Halted:
        clear_halt(job_dir)
        store.set_state(run_id, RunState.HALTED)
        return _result(manifest, job_dir, run_id, RunState.HALTED, last, resumed_from)
    except KeyboardInterrupt:
        store.set_state(run_id, RunState.HALTED, error="interrupted (resume to continue)")
        raise
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        store.set_state(run_id, RunState.FAILED, error=reason)
        raise JobError(
            f"job {run_id} failed after round {last['round']}: {reason} "
            f"(fix the cause, then `fedge aggregator resume --dir {job_dir}`)"
        ) from exc
    store.set_state(run_id, RunState.COMPLETED)
    return _result(manifest, job_dir, run_id, RunState.COMPLETED, last, resumed_from)


def _train(
    manifest: JobManifest,
    job_dir: Path,
    store: RunStore,
    run_id: str,
    checkpoint: Checkpoint | None,
    progress: ProgressFn | None,
    last: dict[str, Any],
) -> None:
    # The training stack (torch, the simulated fleet) is only needed here.
    from flwr.app import ArrayRecord, Message
    from flwr.serverapp import Grid

    from fedge.aggregator.driver import start_rounds
    from fedge.aggregator.rounds.clock import ClockMode
    from fedge.aggregator.rounds.replies import arrays_of
    from fedge.aggregator.strategies.factory import build_strategy
    from fedge.aggregator.strategies.tiered import TieredFedAvg
    from fedge.models import digits
    from fedge.sim.data import make_partitions
    from fedge.sim.grid import InProcessGrid
    from fedge.sim.party_app import app as client_app
    from fedge.sim.party_inputs import PRIVACY_DIR_KEY
    from fedge.sim.runner import evaluator, train_config

    scenario = manifest.scenario
    total = manifest.rounds
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
    if checkpoint is None:
        arrays: ArrayRecord = digits.to_arrays(digits.make_model(arch, seed=manifest.seed))
        first_round = 1
    else:
        restore_strategy(strategy, checkpoint)
        arrays = checkpoint.array_record()
        first_round = checkpoint.round + 1
    if progress is not None:
        progress(first_round - 1, total, last["accuracy"])
    if halt_requested(job_dir):
        raise _Halted(first_round - 1)
    if first_round > total:  # killed after its last checkpoint, before completing
        save_arrays(job_dir / FINAL_MODEL, arrays_of(arrays))
        return

    sim_state = _sim_state(manifest, job_dir, run_id)

    def observe(record: RoundRecord) -> None:
        store.record_round(run_id, record)
        tiers = strategy.tiers if isinstance(strategy, TieredFedAvg) else None
        store.save_profiles(run_id, strategy.profiles, tiers)
        last["round"] = record.server_round
        last["accuracy"] = record.eval_metrics.get(ACCURACY_KEY)
        if progress is not None:
            progress(record.server_round, total, last["accuracy"])

    def checkpoint_fn(server_round: int, round_arrays: ArrayRecord) -> None:
        if checkpoint_round(
            job_dir,
            server_round,
            round_arrays,
            strategy,
            total=total,
            every=manifest.checkpoint.every,
            keep=manifest.checkpoint.keep,
            sim=sim_state,
        ):
            raise _Halted(server_round)

    def observe_replies(record: RoundRecord, replies: dict[int, Message]) -> None:
        store.record_replies(run_id, record.server_round, replies)

    strategy.observers.append(observe)
    strategy.reply_observers.append(observe_replies)
    # The parties' DP ledgers live in the job directory: a resumed job's parties remember
    # what they spent (a round replayed after a kill is trained again: counted again).
    strategy.job_id = run_id
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
        assert isinstance(grid, Grid)
        result, _ = start_rounds(
            strategy,
            grid,
            arrays,
            num_rounds=total,
            timeout=600,
            train_config=train_config(scenario, extra),
            evaluate_fn=evaluator(scenario, data, arch=arch),
            first_round=first_round,
            checkpoint_fn=checkpoint_fn,
            max_weight=_largest_party(data),
        )
    finally:
        grid.close()
    save_arrays(job_dir / FINAL_MODEL, arrays_of(result.arrays))


def _largest_party(data: Any) -> float:
    """SecAgg+'s max_weight: no simulated party reports more examples than this."""
    return float(max(data.party_size(p) for p in range(data.num_parties)))


def _sim_state(manifest: JobManifest, job_dir: Path, run_id: str) -> dict[str, Any]:
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


def _check_compatible(
    checkpoint: Checkpoint, manifest: JobManifest, job_dir: Path, run_id: str
) -> None:
    expected = _sim_state(manifest, job_dir, run_id)
    for key, value in expected.items():
        if key in checkpoint.sim and checkpoint.sim[key] != value:
            raise JobError(
                f"checkpoint {checkpoint.path.name} was written with {key} = "
                f"{checkpoint.sim[key]!r}, but the job now has {value!r}; "
                f"{job_dir / JOB_MANIFEST} or {job_dir / JOB_SCENARIO} changed"
            )


def _result(
    manifest: JobManifest,
    job_dir: Path,
    run_id: str,
    state: RunState,
    last: dict[str, Any],
    resumed_from: int,
) -> JobResult:
    final = job_dir / FINAL_MODEL
    return JobResult(
        run_id=run_id,
        job_dir=job_dir,
        state=state,
        last_round=manifest.rounds if state is RunState.COMPLETED else int(last["round"]),
        rounds=manifest.rounds,
        accuracy=last["accuracy"],
        final_model=final if state is RunState.COMPLETED else None,
        resumed_from=resumed_from,
    )


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


def _recorded_accuracy(store: RunStore, run_id: str, server_round: int) -> float | None:
    for row in store.rounds(run_id):
        if row["round"] == server_round:
            value = row["eval_metrics"].get(ACCURACY_KEY)
            return None if value is None else float(value)
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()

"""One run of a job, whoever trains it: the simulated fleet or the stations of a real one.

Simulated jobs (:mod:`fedge.sim.jobs`) and fleet jobs (:mod:`fedge.aggregator.fleet.server`)
differ only in their grid, their evaluation and their starting model (:class:`JobRounds`);
the rest of a job's life is written here once (:func:`execute_job`):

- **states**: ``running`` while it trains; ``halted`` on a halt request (seen before the
  first round and between rounds; its checkpoint is kept) or on Ctrl-C; ``failed`` with the
  error; ``completed`` -- unless the caller's verdict fails a job whose rounds all ran
  (a fleet job no station trained: issue 24);
- **resume**: from the newest checkpoint (the model, the strategy's state, late replies
  held for staleness folding), refused -- before anything changes -- when the checkpoint
  was written for another job (:attr:`JobRun.resume_state` differs);
- **the past-last-round shortcut**: a job killed after its last checkpoint, before it was
  marked completed, only writes its final model;
- **each round** is recorded in the run store as it ends (the round, its parties' replies,
  the strategy's latency profiles and tiers), then checkpointed (``[checkpoint] every``,
  always at the last round and on a halt: :func:`~.checkpoint.checkpoint_round`).

The rounds themselves are played by :func:`fedge.aggregator.driver.start_rounds` (our
strategy, central DP or SecAgg+, in the one round loop). The caller holds the job's lock
(:func:`~.directory.job_lock`) and has opened its run store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedge.aggregator.driver import start_rounds
from fedge.aggregator.jobs.checkpoint import (
    Checkpoint,
    checkpoint_round,
    latest_checkpoint,
    restore_strategy,
    save_arrays,
)
from fedge.aggregator.jobs.control import ACCURACY_KEY
from fedge.aggregator.jobs.directory import (
    FINAL_MODEL,
    JOB_MANIFEST,
    JobError,
    clear_halt,
    halt_requested,
)
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.jobs.spec import CheckpointSpec
from fedge.aggregator.rounds.loop import EvaluateFn
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.rounds.replies import arrays_of
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.aggregator.strategies.tiered import TieredFedAvg

ProgressFn = Callable[[int, int, float | None], None]
"""Called with (rounds done, total rounds, accuracy) at the start and after each round."""


@dataclass(frozen=True)
class JobRun:
    """The run a job directory holds, as the caller found it (its lock held)."""

    job_dir: Path
    store: RunStore
    run_id: str
    rounds: int
    checkpoint: CheckpointSpec
    resume_state: Mapping[str, Any]
    """Kept in every checkpoint; a checkpoint that disagrees on any of it is not resumed
    (e.g. the seed, or the hash of a simulated job's frozen scenario)."""


@dataclass(frozen=True)
class JobRounds:
    """What trains a job. Built once the job is running, so a failure to build it (a
    data set, a strategy) fails the job like any other."""

    strategy: StreamingFedAvg
    initial_arrays: Callable[[], ArrayRecord]
    """The starting model (read only when there is no checkpoint to resume)."""
    open_grid: Callable[[], AbstractContextManager[Grid]]
    """The parties, opened only when a round is to be played (and closed after)."""
    evaluation: Callable[[Grid], EvaluateFn]
    """The job's evaluation of each round's model, given the open grid."""
    train_config: ConfigRecord
    round_timeout_s: float
    max_weight: float
    """SecAgg+: at least the largest ``num-examples`` a party reports."""
    finish: Callable[[StreamingFedAvg], None] | None = None
    """Called with the strategy once the final model is written, before the job is marked
    completed: what else the job leaves (a distilling fleet job: each tier's model)."""


@dataclass(frozen=True)
class JobResult:
    """How a run of a job ended (a failure raises :class:`JobError` instead)."""

    run_id: str
    job_dir: Path
    state: RunState  # completed or halted; failed only when the caller's verdict says so
    last_round: int
    rounds: int
    accuracy: float | None  # the evaluation's accuracy after last_round
    final_model: Path | None  # <job_dir>/final.npz once completed
    resumed_from: int  # the checkpoint's round (0: started from scratch)


class _Halted(Exception):
    """A halt request was seen: the run stops (after its checkpoint, if a round ran)."""


def execute_job(
    run: JobRun,
    build: Callable[[], JobRounds],
    *,
    progress: ProgressFn | None = None,
    verdict: Callable[[], str | None] | None = None,
) -> JobResult:
    """Run (or continue) ``run`` until its last round, a halt request, or a failure.

    ``verdict``: asked once every round has run; a reason fails the job instead of
    completing it. Raises :class:`JobError` when the job fails (its state says why).
    """
    checkpoint = latest_checkpoint(run.job_dir)
    if checkpoint is not None:
        _check_resumable(checkpoint, run)
    resumed_from = 0 if checkpoint is None else checkpoint.round
    progress_of = _Progress(run, resumed_from, progress)
    run.store.set_state(run.run_id, RunState.RUNNING)
    try:
        _train(run, build(), checkpoint, progress_of)
    except _Halted:
        clear_halt(run.job_dir)
        run.store.set_state(run.run_id, RunState.HALTED)
        return progress_of.result(RunState.HALTED)
    except KeyboardInterrupt:
        run.store.set_state(run.run_id, RunState.HALTED, error="interrupted (resume to continue)")
        raise
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        run.store.set_state(run.run_id, RunState.FAILED, error=reason)
        raise JobError(
            f"job {run.run_id} failed after round {progress_of.last_round}: {reason} "
            f"(fix the cause, then `fedge aggregator resume --dir {run.job_dir}`)"
        ) from exc
    except BaseException as exc:  # SystemExit and the like: recorded, not wrapped
        run.store.set_state(run.run_id, RunState.FAILED, error=f"{type(exc).__name__}: {exc}")
        raise
    failed = verdict() if verdict is not None else None
    if failed is not None:
        run.store.set_state(run.run_id, RunState.FAILED, error=failed)
        return progress_of.result(RunState.FAILED)
    run.store.set_state(run.run_id, RunState.COMPLETED)
    return progress_of.result(RunState.COMPLETED)


def _train(run: JobRun, job: JobRounds, checkpoint: Checkpoint | None, progress: _Progress) -> None:
    strategy = job.strategy
    if checkpoint is None:
        arrays = job.initial_arrays()
        first_round = 1
    else:
        restore_strategy(strategy, checkpoint)
        arrays = checkpoint.array_record()
        first_round = checkpoint.round + 1
    progress.report()
    if halt_requested(run.job_dir):
        raise _Halted()
    if first_round > run.rounds:  # killed after its last checkpoint, before completing
        save_arrays(run.job_dir / FINAL_MODEL, arrays_of(arrays))
        if job.finish is not None:
            job.finish(strategy)
        return

    store, run_id = run.store, run.run_id

    def observe(record: RoundRecord) -> None:
        store.record_round(run_id, record)
        tiers = strategy.tiers if isinstance(strategy, TieredFedAvg) else None
        store.save_profiles(run_id, strategy.profiles, tiers)
        progress.round_ended(record)

    def observe_replies(record: RoundRecord, replies: dict[int, Message]) -> None:
        store.record_replies(run_id, record.server_round, replies)

    def checkpoint_fn(server_round: int, round_arrays: ArrayRecord) -> None:
        if checkpoint_round(
            run.job_dir,
            server_round,
            round_arrays,
            strategy,
            total=run.rounds,
            every=run.checkpoint.every,
            keep=run.checkpoint.keep,
            sim=run.resume_state,
        ):
            raise _Halted()

    strategy.observers.append(observe)
    strategy.reply_observers.append(observe_replies)
    # The parties account their DP-SGD rounds under the job's run id (their ledgers): a
    # resumed job's parties remember what they spent (a round replayed after a kill is
    # trained again: counted again).
    strategy.job_id = run_id
    with job.open_grid() as grid:
        result, _ = start_rounds(
            strategy,
            grid,
            arrays,
            num_rounds=run.rounds,
            timeout=job.round_timeout_s,
            train_config=job.train_config,
            evaluate_fn=job.evaluation(grid),
            first_round=first_round,
            checkpoint_fn=checkpoint_fn,
            max_weight=job.max_weight,
        )
    save_arrays(run.job_dir / FINAL_MODEL, arrays_of(result.arrays))
    if job.finish is not None:
        job.finish(strategy)


class _Progress:
    """The last round recorded and its accuracy: reported as rounds end, and how the run
    ended."""

    def __init__(self, run: JobRun, resumed_from: int, report: ProgressFn | None) -> None:
        self.run = run
        self.resumed_from = resumed_from
        self.last_round = resumed_from
        self.accuracy = _recorded_accuracy(run.store, run.run_id, resumed_from)
        self._report = report

    def report(self) -> None:
        if self._report is not None:
            self._report(self.last_round, self.run.rounds, self.accuracy)

    def round_ended(self, record: RoundRecord) -> None:
        self.last_round = record.server_round
        self.accuracy = record.eval_metrics.get(ACCURACY_KEY)
        self.report()

    def result(self, state: RunState) -> JobResult:
        completed = state is RunState.COMPLETED
        return JobResult(
            run_id=self.run.run_id,
            job_dir=self.run.job_dir,
            state=state,
            last_round=self.run.rounds if completed else self.last_round,
            rounds=self.run.rounds,
            accuracy=self.accuracy,
            final_model=self.run.job_dir / FINAL_MODEL if completed else None,
            resumed_from=self.resumed_from,
        )


def _check_resumable(checkpoint: Checkpoint, run: JobRun) -> None:
    for key, value in run.resume_state.items():
        if key in checkpoint.sim and checkpoint.sim[key] != value:
            raise JobError(
                f"checkpoint {checkpoint.path.name} was written with {key} = "
                f"{checkpoint.sim[key]!r}, but the job now has {value!r}; "
                f"{run.job_dir / JOB_MANIFEST} or a file it names changed since"
            )


def _recorded_accuracy(store: RunStore, run_id: str, server_round: int) -> float | None:
    for row in store.rounds(run_id):
        if row["round"] == server_round:
            value = row["eval_metrics"].get(ACCURACY_KEY)
            return None if value is None else float(value)
    return None

"""Job directories any process can inspect or halt: status and halt, for every kind of job.

Simulated jobs are run and resumed by :mod:`fedge.sim.jobs`, fleet jobs by
:mod:`fedge.federation.fleet_job`; both keep the layout of :mod:`.job_dir`, so
``fedge aggregator status`` and ``halt`` work on either.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.aggregator.jobs.checkpoint import (
    atomic_write_text,
    checkpoint_rounds,
)
from fedge.aggregator.jobs.directory import (
    HALT_REQUEST,
    RUNS_DB,
    BusyError,
    JobError,
    clear_halt,
    is_live,
    job_lock,
)
from fedge.aggregator.jobs.run_store import RunState, RunStore

ACCURACY_KEY = "accuracy"


@dataclass(frozen=True)
class RunStatus:
    """One run of a job directory, as ``fedge aggregator status`` shows it."""

    run_id: str
    name: str
    state: RunState
    live: bool  # a process is running it right now
    last_round: int
    rounds: int
    accuracy: float | None
    checkpoint_round: int | None
    halt_requested: bool
    error: str
    created_at: float
    updated_at: float
    # Fleet jobs: each station's accuracy on its own held-out images, per round (0: the
    # starting model), as {"round", "party", "accuracy", "examples", "error"} rows.
    evaluations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Jobs with DP-SGD: each party's rounds trained and epsilon spent; central DP: one row
    # for every station, its released rounds and station epsilon (RunStore.privacy_spent).
    privacy: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["state"] = self.state.value
        return data


# ---------------------------------------------------------------- public API


def halt_job(job_dir: Path | str) -> RunState:
    """Ask a job to halt between rounds; returns the job's state right after asking.

    A job being run by a process gets a halt request and stops after its current round
    (its state stays ``running`` until then). A job nobody runs (its process was killed)
    is marked ``halted`` at once. A job that already ended is an error.
    """
    job_dir = Path(job_dir)
    require_job(job_dir)
    store = RunStore(job_dir / RUNS_DB)
    try:
        run = the_run(store, job_dir)
        run_id, state = str(run["run_id"]), RunState(run["state"])
        if state in (RunState.COMPLETED, RunState.FAILED, RunState.HALTED):
            raise JobError(f"job {run_id} is {state.value}; there is nothing to halt")
        atomic_write_text(
            job_dir / HALT_REQUEST,
            json.dumps({"requested_at": time.time(), "by_pid": os.getpid()}) + "\n",
        )
        try:
            with job_lock(job_dir, wait_s=0.0):
                # Nobody runs it (and nobody can start to while we hold the lock).
                state = RunState(the_run(store, job_dir)["state"])
                if state in (RunState.QUEUED, RunState.RUNNING):
                    store.set_state(run_id, RunState.HALTED)
                    state = RunState.HALTED
                clear_halt(job_dir)
        except BusyError:
            pass  # the runner sees the request after its current round
        return state
    finally:
        store.close()


def job_status(job_dir: Path | str) -> list[RunStatus]:
    """Every run of ``job_dir`` with its state, last round and last test accuracy."""
    job_dir = Path(job_dir)
    require_job(job_dir)
    store = RunStore(job_dir / RUNS_DB)
    try:
        live = is_live(job_dir)
        checkpoints = checkpoint_rounds(job_dir)
        statuses = []
        for row in store.runs():
            run = store.run(row["run_id"]) or {}
            name, rounds = manifest_summary(str(run.get("manifest", "")))
            recorded = store.rounds(row["run_id"])
            accuracy = None
            if recorded:
                value = recorded[-1]["eval_metrics"].get(ACCURACY_KEY)
                accuracy = None if value is None else float(value)
            state = RunState(row["state"])
            statuses.append(
                RunStatus(
                    run_id=str(row["run_id"]),
                    name=name,
                    state=state,
                    live=live and state in (RunState.QUEUED, RunState.RUNNING),
                    last_round=int(row["last_round"]),
                    rounds=rounds,
                    accuracy=accuracy,
                    checkpoint_round=checkpoints[-1] if checkpoints else None,
                    halt_requested=(job_dir / HALT_REQUEST).exists(),
                    error=str(row["error"]),
                    created_at=float(row["created_at"]),
                    updated_at=float(row["updated_at"]),
                    evaluations=store.evaluations(row["run_id"]),
                    privacy=store.privacy_spent(row["run_id"]),
                )
            )
        return statuses
    finally:
        store.close()


# ---------------------------------------------------------------- the job directory


def require_job(job_dir: Path) -> None:
    if not (job_dir / RUNS_DB).is_file():
        raise JobError(
            f"no job in {job_dir} (no {RUNS_DB}); start one with "
            f"`fedge aggregator run JOB.toml --dir {job_dir}`"
        )


def the_run(store: RunStore, job_dir: Path) -> dict[str, Any]:
    runs = store.runs()
    if not runs:
        raise JobError(f"the run store of {job_dir} holds no run")
    run = store.run(runs[-1]["run_id"])
    assert run is not None
    return run


def manifest_summary(text: str) -> tuple[str, int]:
    """Name and rounds of a stored manifest, without validating it again."""
    try:
        job = tomllib.loads(text).get("job", {})
    except tomllib.TOMLDecodeError:
        return "", 0
    rounds = job.get("rounds", 0)
    return str(job.get("name", "")), rounds if isinstance(rounds, int) else 0

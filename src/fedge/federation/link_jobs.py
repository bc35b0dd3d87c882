"""The job queue's fleet jobs on the fleet's SuperLink (issue 31): the real
:class:`~fedge.federation.queue_runner.FleetJobs`, and queueing a fleet job manifest.

A queued fleet job is a job directory holding the manifest it was submitted with
(:data:`QUEUED_MANIFEST`). When the scheduler places it, :meth:`SuperLinkJobs.start`
prepares it on the stations it was given (:func:`~fedge.federation.prepare.prepare`
with them as the job's edges: its party map, and so its checkpoint, belongs to them)
and submits it (``flwr run``, signed by the manager's key). Suspending it is
``fedge aggregator halt``'s request: the ServerApp stops after its current round and
checkpoints; resuming submits it again and it continues from that checkpoint, every
round recorded once (the run store keys rounds by number). Past its grace period a run
is stopped by killing its ServerApp (the process that holds the job's lock): the round
in flight is lost and played again on resume -- FitGpp's grace period is the time a
job has to stop by itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from fedge.aggregator.fleet.manifest import load_fleet_manifest
from fedge.aggregator.jobs.control import halt_job
from fedge.aggregator.jobs.directory import (
    HALT_REQUEST,
    LOCK_FILE,
    RUNS_DB,
    JobError,
    clear_halt,
    is_live,
)
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.policy import Policy
from fedge.edge_manager.scheduler.queue import Actions
from fedge.edge_manager.scheduler.service import fleet_stations, submit_job
from fedge.edge_manager.scheduler.store import JobRecord
from fedge.edge_manager.store import Store
from fedge.federation.queue_runner import QueueRunner, RunView

QUEUED_MANIFEST = "queued.toml"
_STOP_WAIT_S = 10.0  # a SIGKILLed ServerApp lets go of the job's lock at once


def queue_fleet_job(
    store: Store,
    manifest_path: Path,
    job_dir: Path,
    *,
    kind: str,
    team: str,
    stations: str,
    grace_s: float,
    max_preemptions: int,
    priority: int,
    who: str,
    now: float,
    job_id: str | None = None,
) -> JobRecord:
    """Check a fleet job manifest and queue it to run in ``job_dir``; a bad manifest or
    submission raises and leaves neither a queued job nor a job directory behind."""
    manifest = load_fleet_manifest(manifest_path)
    if (job_dir / RUNS_DB).exists() or (job_dir / QUEUED_MANIFEST).exists():
        raise SchedulerError(f"{job_dir} already holds a job; choose another directory")
    created = not job_dir.exists()
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / QUEUED_MANIFEST).write_text(manifest.text, encoding="utf-8")
    try:
        return submit_job(
            store,
            kind=kind,
            team=team,
            stations=stations,
            grace_s=grace_s,
            max_preemptions=max_preemptions,
            priority=priority,
            job_dir=str(job_dir.resolve()),
            who=who,
            now=now,
            job_id=job_id or f"{manifest.name}-{os.urandom(4).hex()}",
        )
    except BaseException:
        (job_dir / QUEUED_MANIFEST).unlink()
        if created:
            shutil.rmtree(job_dir, ignore_errors=True)
        raise


class SuperLinkJobs:
    """Fleet jobs on the home's running SuperLink; times are POSIX seconds."""

    def __init__(self, home: ManagerHome, *, root_certificates: Path | None = None) -> None:
        self.home = home
        self.root_certificates = root_certificates

    # The fleet job modules are imported where a job is run, not at this module's import:
    # they bring torch (a job's model families), which queueing a manifest
    # (`fedge jobs submit`, queue_fleet_job above) does not need -- about 1.4 s of CPU.

    def start(self, record: JobRecord, stations: tuple[str, ...]) -> None:
        from fedge.federation.fleet_job import submit_to_fleet
        from fedge.federation.prepare import prepare

        job_dir = _dir(record)
        if not (job_dir / RUNS_DB).exists():
            prepare(job_dir / QUEUED_MANIFEST, job_dir, self.home, edges=stations)
        submit_to_fleet(job_dir, self.home, root_certificates=self.root_certificates)

    def resume(self, record: JobRecord) -> None:
        from fedge.federation.fleet_job import submit_to_fleet

        job_dir = _dir(record)
        clear_halt(job_dir)  # resuming is the newer request
        submit_to_fleet(job_dir, self.home, root_certificates=self.root_certificates)

    def halt(self, record: JobRecord) -> None:
        job_dir = _dir(record)
        if not (job_dir / HALT_REQUEST).exists():
            halt_job(job_dir)

    def force_stop(self, record: JobRecord) -> None:
        job_dir = _dir(record)
        if is_live(job_dir):
            try:
                pid = int((job_dir / LOCK_FILE).read_text().strip())
            except (OSError, ValueError) as exc:
                raise JobError(f"cannot read who runs the job in {job_dir}: {exc}") from exc
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + _STOP_WAIT_S
            while is_live(job_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
            if is_live(job_dir):  # not gone yet: never record a running job as halted
                raise JobError(
                    f"the ServerApp of {job_dir} (pid {pid}) still holds the job after "
                    f"{_STOP_WAIT_S:g} s; the runner asks again at its next step"
                )
        halt_job(job_dir)  # nobody runs it now: marked halted at once

    def view(self, record: JobRecord) -> RunView | None:
        from fedge.federation.fleet_job import DEAD_GRACE_S, submitted_at

        job_dir = _dir(record)
        if not (job_dir / RUNS_DB).exists():
            return None
        store = RunStore(job_dir / RUNS_DB)
        try:
            runs = store.runs()
        finally:
            store.close()
        if not runs:
            return None
        state = RunState(runs[-1]["state"])
        live = is_live(job_dir) or (
            state in (RunState.QUEUED, RunState.RUNNING)
            and time.time() - submitted_at(job_dir) < DEAD_GRACE_S
        )
        return RunView(state, float(runs[-1]["updated_at"]), live)

    def completed(self, record: JobRecord) -> str:
        from fedge.federation.publish import publish

        return f"published {publish(_dir(record), self.home)}"


def _dir(record: JobRecord) -> Path:
    if not record.job_dir:
        raise JobError(
            f"job {record.job.job_id} names no job directory; it cannot run on the fleet "
            "(submit it with --manifest and --job-dir)"
        )
    return Path(record.job_dir)


def run_queue(
    home: ManagerHome,
    policy: Policy,
    *,
    poll_s: float,
    stop: Callable[[], bool],
    on_step: Callable[[Actions], None],
    root_certificates: Path | None = None,
) -> None:
    """The queue runner's loop (``fedge jobs run``) until ``stop()``: one step per
    ``poll_s``, wall-clock time."""
    store = Store(home.db_path)
    try:
        runner = QueueRunner(
            store,
            SuperLinkJobs(home, root_certificates=root_certificates),
            policy,
            lambda: fleet_stations(store),
        )
        while not stop():
            on_step(runner.step(time.time()))
            time.sleep(poll_s)
    finally:
        store.close()

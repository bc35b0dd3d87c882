"""A job directory's layout, its lock and its halt request (shared by every kind of job).

::

    <job_dir>/
        job.toml              the manifest, as submitted
        runs.db               the run store: the run's state and every round
        checkpoints/          round-NNNNNN.npz, atomic (fedge.aggregator.jobs.checkpoint)
        final.npz             the final model's arrays, once completed
        halt-request          present while a halt is requested
        .lock                 flock'd by the process running the job

Only one process runs a job at a time: it holds ``.lock`` (``flock``), which the kernel
releases when the process dies however it dies, so "running" in the store plus a free
lock means the runner was killed and the job can be resumed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from fedge.aggregator.errors import AggregatorError

JOB_MANIFEST = "job.toml"
JOB_SCENARIO = "scenario.toml"
RUNS_DB = "runs.db"
FINAL_MODEL = "final.npz"
LEDGERS = "ledgers"  # simulated parties' DP-SGD budget ledgers (fedge.party.budget)
HALT_REQUEST = "halt-request"
LOCK_FILE = ".lock"
LOCK_WAIT_S = 2.0  # a `status` probing the lock holds it for an instant


class JobError(AggregatorError):
    """A job cannot be started, resumed or halted, or it failed while running."""


class BusyError(JobError):
    """Another process holds the job's lock."""


@contextlib.contextmanager
def job_lock(job_dir: Path, *, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the job's lock for the block; raise JobError if another process runs the job."""
    fd = os.open(job_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise BusyError(
                        f"another process is running the job in {job_dir}; "
                        f"halt it first (`fedge aggregator halt --dir {job_dir}`)"
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def is_live(job_dir: Path) -> bool:
    """Whether some process holds the job's lock (i.e. is running it now)."""
    try:
        fd = os.open(job_dir / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)
    return False


def halt_requested(job_dir: Path) -> bool:
    return (job_dir / HALT_REQUEST).exists()


def clear_halt(job_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (job_dir / HALT_REQUEST).unlink()

"""One process per role: an exclusive ``flock`` on a file that names the holder's pid.

The kernel drops the lock when the holder dies, however it dies, so a stale file never
blocks a restart and "is it running?" is answered by the lock, not by a pid that may have
been reused. Callers translate :class:`Held` into their own package's error.
"""

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

PROBE_RETRIES = 5


@dataclass(frozen=True)
class Held:
    """Another process holds the lock; ``pid`` is what it wrote (None: unreadable)."""

    pid: int | None


def _pid_in(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def acquire(path: Path) -> int | Held:
    """Take the lock and write our pid; return the descriptor to keep open (or who holds it).

    Raises OSError when the file cannot be created or locked at all.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    # A few tries: :func:`holder` probes take the lock for an instant, and a start must
    # not be refused for that.
    for attempt in range(PROBE_RETRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == PROBE_RETRIES - 1:
                held = Held(_pid_in(fd))
                os.close(fd)
                return held
            time.sleep(0.02)
        except OSError:
            os.close(fd)
            raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def holder(path: Path) -> Held | None:
    """Who holds the lock at ``path`` now, or None when nobody does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return Held(_pid_in(fd))
    finally:
        os.close(fd)  # also releases the shared lock taken to test it
    return None

"""One running agent per data directory: an exclusive ``flock`` on ``<data_dir>/agent.lock``.

The lock is held for the life of the process (the kernel drops it when the process dies,
however it dies), and the file names the holder's pid for the refusal message.
"""

import fcntl
import os
from pathlib import Path

from fedge.edge_agent.errors import AgentError

LOCK_FILE = "agent.lock"


class DataDirLockedError(AgentError):
    """Another agent holds the data directory."""


def lock_data_dir(data_dir: Path) -> int:
    """Take the data directory's lock and write our pid in it; return the open descriptor.

    Keep the descriptor open for as long as the agent runs: closing it releases the lock.
    """
    path = data_dir / LOCK_FILE
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise AgentError(f"cannot open {path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DataDirLockedError(
            f"another agent (pid {holder}) is running on {data_dir}; stop it first, "
            "or give this one its own data_dir"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise AgentError(f"cannot lock {path}: {exc.strerror}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd

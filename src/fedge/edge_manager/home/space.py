"""The room left on the manager store's file system (issue 33): how much, and is it low.

A full disk stops ingest (the messages wait, see :mod:`fedge.edge_manager.ingest.hold`);
headroom is what keeps it from getting there. :class:`Headroom` judges a measurement
(pure): space is *low* below ``min_free_percent`` of the file system or below
``min_free_mib``, whichever is more room (5 % or 500 MiB by default: a large disk warns
with days of data to spare, a small one before its last half gigabyte). Low, `manager
serve` warns once and prunes by its retention rules at once and then more often
(retention.py), and `doctor` and `manager status` say so.

The adapters here only look (:func:`measure`) or write and remove one small file
(:func:`probe`); neither reads a secret or keeps a handle.
"""

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from fedge.edge_manager.errors import ManagerError

MIB = 1024 * 1024
PROBE_BYTES = 64 * 1024


@dataclass(frozen=True)
class DiskSpace:
    """One measurement of the file system holding ``path``."""

    path: str
    free_bytes: int  # available to this (non-root-reserved) user
    total_bytes: int

    @property
    def free_percent(self) -> float:
        return 100.0 * self.free_bytes / self.total_bytes if self.total_bytes else 0.0


@dataclass(frozen=True)
class Headroom:
    min_free_percent: float = 5.0
    min_free_mib: float = 500.0

    def threshold_bytes(self, total_bytes: int) -> int:
        return int(max(total_bytes * self.min_free_percent / 100.0, self.min_free_mib * MIB))

    def low(self, space: DiskSpace) -> bool:
        return space.free_bytes < self.threshold_bytes(space.total_bytes)

    def describe(self) -> str:
        return f"{self.min_free_percent:g} % or {self.min_free_mib:g} MiB"


def _size(n: int) -> str:
    for unit, scale in (("GiB", MIB * 1024), ("MiB", MIB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def describe_space(space: DiskSpace) -> str:
    """E.g. "1.2 MiB free of 4.0 MiB (30.0 %) on /srv/fedge"."""
    return (
        f"{_size(space.free_bytes)} free of {_size(space.total_bytes)} "
        f"({space.free_percent:.1f} %) on {space.path}"
    )


def low_line(space: DiskSpace, headroom: Headroom) -> str:
    """The one line said when space becomes low."""
    return (
        f"store space low: {describe_space(space)}, under the headroom of "
        f"{headroom.describe()}; pruning by the retention rules now and every few seconds "
        "until it is not; free space there or lower keep_*_days in manager.toml"
    )


def measure(path: Path) -> DiskSpace | None:
    """The file system holding ``path`` (or its nearest existing parent); None if unreadable."""
    probe_at = path
    while not probe_at.exists() and probe_at != probe_at.parent:
        probe_at = probe_at.parent
    try:
        usage = shutil.disk_usage(probe_at)
    except OSError:
        return None
    return DiskSpace(str(probe_at), int(usage.free), int(usage.total))


def probe(directory: Path, size: int = PROBE_BYTES) -> str | None:
    """Write ``size`` bytes to a new file in ``directory``, sync and remove it: None if that
    worked, else what failed (the store needs at least that much room to take a write)."""
    path = directory / f".space-probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written = os.write(fd, b"\0" * size)
            if written < size:  # a short write: the file system ran out part way
                raise OSError(28, "No space left on device")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"cannot write {size // 1024} KiB in {directory}: {exc.strerror or exc}"
    finally:
        path.unlink(missing_ok=True)
    return None


@dataclass(frozen=True)
class StoreHealth:
    """What serve knows of its store now (``manager status``, serve.json)."""

    state: str  # "ok", "low" (space under the headroom) or "unwritable"
    detail: str  # the store's error when unwritable; the space line when low
    free_bytes: int | None
    held: int  # messages waiting in memory for the store
    since: float | None  # when it became unwritable (or low)


def require_writable_store(db_path: Path) -> None:
    """Refuse to serve on a store that cannot take a write (issue 33): every message
    would wait in memory from the first one."""
    why = probe(db_path.parent)
    if why is None:
        return
    measured = measure(db_path)
    room = "" if measured is None else f" ({describe_space(measured)})"
    raise ManagerError(
        f"cannot serve: the store {db_path} is not writable: {why}{room}; "
        "free space on that file system (or fix its permissions), then start serve again"
    )

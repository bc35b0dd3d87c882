"""Resident memory of this process, as the kernel counts it (Linux ``/proc``).

What the aggregation benchmark's child measures with (:func:`status_kib` for ``VmRSS``
and ``VmHWM``, :func:`reset_peak_rss`), what it does to start from live memory only
(:func:`malloc_trim`), and what the parent checks before it starts a side that holds
every reply at once (:func:`mem_available_bytes`). Used by :mod:`fedge.bench.aggregate`.
"""

import contextlib
import ctypes
import ctypes.util
from pathlib import Path

from fedge.bench.testbed import BenchError


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])  # "VmHWM:   123456 kB"
    raise BenchError(f"/proc/self/status has no {field} (Linux only)")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0).

    Why not ``ru_maxrss``: it cannot be reset, and on exec Linux folds the *parent's* peak
    RSS into the child's (``exec_mmap`` -> ``setmax_mm_hiwater_rss(&sig->maxrss, old_mm)``),
    so a child started from a big process (pytest, a notebook) reports the parent's peak.
    ``VmHWM`` belongs to the child's own address space; the kernel records it before any
    unmap/``MADV_DONTNEED``/brk shrink lowers RSS, so transient peaks (a temporary freed
    microseconds later) are not missed the way sampling ``VmRSS`` would miss them. Without
    the reset (clear_refs not writable) ``VmHWM`` still starts at exec; the imports and the
    warm-up before the baseline use far less than a round, so it stays a sound peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def malloc_trim() -> None:
    """Hand free heap memory back to the OS (glibc), so the baseline is live memory only."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


def mem_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None

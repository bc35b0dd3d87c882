"""Files arriving whole in a directory, as the kernel reports them: Linux inotify(7).

A camera either writes a file and closes it (``IN_CLOSE_WRITE``) or writes it elsewhere
and renames it in (``IN_MOVED_TO``); either event says the file is complete at that
moment, so it can be scored at once instead of after a settle time measured by polling
(the watcher's scans: 0.2-0.4 s per image at the defaults, issue 25). The watcher still
scans as a backstop: inotify does not see writes made by another host to a network file
system (a camera writing to an NFS or SMB share mounted on the station), an event queue
can overflow, and a file named by an event that does not decode yet (a writer that
closed it and opened it again) is left to the scans' settle rule.

A thin adapter over the three system calls through ctypes (no dependency); where there
is no inotify (not Linux, or the watch cannot be added) :func:`open_arrivals` returns
None and the watcher polls as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# <sys/inotify.h>
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)

WATCHED = IN_CLOSE_WRITE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
_READ_BYTES = 64 * 1024


@dataclass(frozen=True)
class Arrived:
    """What one wait saw: names of files that arrived whole, in order (repeats kept out),
    and whether the watcher must look for itself (events were lost, or the directory
    itself went away and must be watched anew)."""

    names: tuple[str, ...] = ()
    overflowed: bool = False
    gone: bool = False


def parse_events(data: bytes) -> Arrived:
    """The events in one read of an inotify descriptor; a truncated or malformed tail
    (which the kernel never writes) is an overflow: the caller rescans."""
    names: dict[str, None] = {}
    overflowed = gone = False
    offset = 0
    while offset < len(data):
        if offset + _HEADER.size > len(data):
            return Arrived(tuple(names), True, gone)
        _, mask, _, length = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        if offset + length > len(data):
            return Arrived(tuple(names), True, gone)
        raw = data[offset : offset + length].split(b"\0", 1)[0]
        offset += length
        if mask & IN_Q_OVERFLOW:
            overflowed = True
        if mask & _GONE:
            gone = True
        if mask & (IN_CLOSE_WRITE | IN_MOVED_TO) and not mask & IN_ISDIR and raw:
            names[os.fsdecode(raw)] = None
    return Arrived(tuple(names), overflowed, gone)


class DirectoryArrivals:
    """An inotify watch on one directory (use :func:`open_arrivals`)."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def wait(self, timeout_s: float) -> Arrived:
        """What arrived, waiting up to ``timeout_s`` for the first event."""
        if self._fd < 0:
            return Arrived(gone=True)
        if not self._poll.poll(max(0, int(timeout_s * 1000))):
            return Arrived()
        chunks = []
        while True:
            try:
                chunk = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                break
            except OSError as exc:  # the descriptor is unusable: the scans take over
                log.warning("reading inotify events for %s: %s", self.directory, exc)
                return Arrived(overflowed=True, gone=True)
            if not chunk:
                break
            chunks.append(chunk)
            if len(chunk) < _READ_BYTES:
                break
        return parse_events(b"".join(chunks))

    def close(self) -> None:
        if self._fd >= 0:
            self._poll.unregister(self._fd)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DirectoryArrivals:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_arrivals(directory: Path) -> DirectoryArrivals | None:
    """A watch on ``directory`` for files closed after writing or moved in; None where
    inotify is unavailable (the caller polls), with the reason logged."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols (libc's among them): find_library would run ldconfig.
        libc = ctypes.CDLL(None, use_errno=True)
        init, add = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError) as exc:
        log.info("no inotify here (%s): the inbox is polled", exc)
        return None
    init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
    add.argtypes, add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
    fd = init(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        log.warning("inotify_init1: %s: the inbox is polled", os.strerror(ctypes.get_errno()))
        return None
    if add(fd, os.fsencode(directory), WATCHED) < 0:
        code = ctypes.get_errno()
        os.close(fd)
        # ENOSPC: the host's fs.inotify.max_user_watches is used up by other programs.
        hint = " (raise fs.inotify.max_user_watches)" if code == errno.ENOSPC else ""
        log.warning(
            "cannot watch %s with inotify: %s%s: the inbox is polled",
            directory,
            os.strerror(code),
            hint,
        )
        return None
    return DirectoryArrivals(directory, fd)

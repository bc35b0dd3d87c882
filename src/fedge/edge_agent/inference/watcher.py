"""Score images dropped into a watched directory, exactly once each.

Where the kernel says when a file arrives whole (Linux inotify: closed after writing, or
renamed in; :mod:`fedge.edge_agent.inference.arrivals`), it is scored at once. Otherwise,
and as the backstop for what no event reports (a network file system's remote writes, a
lost event, a file that did not decode when its event came), the directory is scanned: a
file is scored only once it has stopped changing (same size and mtime on two scans,
and older than ``settle_s``): a camera or ``cp`` writing a large image must not be caught
half-way. A file that still does not decode is retried until it has been quiet for
``give_up_s``, then moved to ``failed/``. Writers that can should still write elsewhere
and rename into the inbox.

Every arrival is scored once, whatever its name (issue 15: a camera that reuses file
names must not lose images). A prediction is reported with ``file:<name>`` as its source
and recorded on the station with the file's *arrival key* (:func:`arrival_key`: name,
size, mtime, inode and content hash) in the same commit; a file still in the inbox after a
crash (scored and committed, not yet moved) matches its key and is moved on without being
scored again, while a new file under a used name does not. ``done/`` and ``failed/`` keep
every file: a name already there gets a suffix.
"""

import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fedge.edge_agent.agent import EdgeAgent, ImageFile
from fedge.edge_agent.errors import InferenceError
from fedge.edge_agent.inference.arrivals import DirectoryArrivals, open_arrivals
from fedge.edge_agent.inference.images import MAX_IMAGE_BYTES

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".pgm"})


@dataclass(frozen=True)
class Arrival:
    """One file as it lies in the inbox: its bytes and what identifies this arrival."""

    name: str
    data: bytes
    size: int
    mtime_ns: int
    inode: int

    @property
    def source(self) -> str:
        return f"file:{self.name}"

    @property
    def key(self) -> str:
        return arrival_key(self.name, self.size, self.mtime_ns, self.inode, self.data)


def arrival_key(name: str, size: int, mtime_ns: int, inode: int, data: bytes) -> str:
    """What tells this arrival from any other, including a later file of the same name.

    The stat signature changes whenever a file is written or renamed in anew (even with
    the same bytes: a second identical image is a second part); the content hash covers
    file systems with coarse mtimes that rewrite in place. A file left untouched in the
    inbox (a crash between commit and move) keeps its key.
    """
    digest = hashlib.sha256(data).hexdigest()
    return f"{name}|{size}|{mtime_ns}|{inode}|{digest}"


def read_arrival(path: Path) -> Arrival:
    """The file's bytes and stat from one open descriptor (both describe the same file)."""
    with path.open("rb") as file:
        stat = os.fstat(file.fileno())
        if stat.st_size > MAX_IMAGE_BYTES:
            raise InferenceError(f"{path.name} is larger than {MAX_IMAGE_BYTES} bytes")
        data = file.read()
    return Arrival(path.name, data, stat.st_size, stat.st_mtime_ns, stat.st_ino)


def free_destination(directory: Path, name: str) -> Path:
    """``directory/name``, or a suffixed name when one is there already (never overwrite).

    A random suffix, not a counter: a camera reusing one name would otherwise cost a
    probe per earlier file.
    """
    target = directory / name
    while target.exists():
        stem, suffix = os.path.splitext(name)
        target = directory / f"{stem}~{uuid.uuid4().hex[:8]}{suffix}"
    return target


def _move(path: Path, directory: Path) -> None:
    """``path`` into ``directory`` under a free name, making the directory again if it
    was removed while the watcher ran."""
    try:
        path.replace(free_destination(directory, path.name))
    except FileNotFoundError:
        if not path.exists():
            raise
        directory.mkdir(parents=True, exist_ok=True)
        path.replace(free_destination(directory, path.name))


class InboxWatcher:
    def __init__(
        self,
        agent: EdgeAgent,
        inbox: Path,
        *,
        settle_s: float = 0.2,
        give_up_s: float = 30.0,
        batch_size: int = 32,
    ) -> None:
        self.agent = agent
        self.inbox = inbox
        self.settle_s = settle_s
        self.give_up_s = give_up_s
        # Files that settled together are scored together: one model call and one commit
        # per batch (a burst from a line camera costs far less than file by file).
        self.batch_size = batch_size
        self.done = inbox / "done"
        self.failed = inbox / "failed"
        self._last_seen: dict[Path, tuple[int, int]] = {}
        self._made = False  # done/ and failed/ exist (made again if someone removes them)

    def made_again(self) -> None:
        """The inbox was removed and made again: make done/ and failed/ on the next scan."""
        self._made = False

    def _settled(self, path: Path) -> bool:
        stat = path.stat()
        signature = (stat.st_size, stat.st_mtime_ns)
        previous = self._last_seen.get(path)
        self._last_seen[path] = signature
        old_enough = time.time() - stat.st_mtime >= self.settle_s
        return previous == signature and old_enough

    def scan_once(self) -> int:
        if not self._made:  # once, not per scan: two scans per file were four mkdirs
            self.done.mkdir(parents=True, exist_ok=True)
            self.failed.mkdir(exist_ok=True)
            self._made = True
        present = sorted(p for p in self.inbox.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        for gone in set(self._last_seen) - set(present):
            del self._last_seen[gone]
        if self.agent.model is None:
            return 0  # keep the images until a model arrives
        ready: list[Path] = []
        for path in present:
            try:
                if self._settled(path):
                    ready.append(path)
            except FileNotFoundError:
                continue
        scored = 0
        for start in range(0, len(ready), self.batch_size):
            scored += self._score_batch(ready[start : start + self.batch_size])
        return scored

    def score_arrived(self, names: Iterable[str]) -> int:
        """Score the files an event named as whole (closed after writing, or moved in):
        no settle time. A name that is no image file here, or is gone, is skipped; one
        that does not decode stays for the scans' settle rule (a writer that closed it
        and opened it again)."""
        paths = [
            self.inbox / name
            for name in names
            if "/" not in name and Path(name).suffix.lower() in IMAGE_SUFFIXES
        ]
        if not paths or self.agent.model is None:
            return 0  # without a model the scans keep them until one arrives
        scored = 0
        for start in range(0, len(paths), self.batch_size):
            scored += self._score_batch(paths[start : start + self.batch_size])
        return scored

    def _score_batch(self, paths: list[Path]) -> int:
        """Score the settled files of one batch (one model call, one commit), move them on."""
        files: list[tuple[Path, ImageFile]] = []
        finished: list[Path] = []
        for path in paths:
            try:
                arrival = read_arrival(path)
            except InferenceError as exc:
                self._not_scored(path, exc)
                continue
            except FileNotFoundError:
                continue
            key = arrival.key
            if self.agent.store.scored_arrival(key, arrival.source, arrival.mtime_ns / 1e9):
                self.agent.counters["watch.already_scored"] += 1
                finished.append(path)  # scored before a crash; only the move was left
                continue
            files.append((path, ImageFile(arrival.data, path.suffix, arrival.source, key)))
        scored = 0
        if files:
            results = self.agent.score_images([file for _, file in files])
            for (path, _), result in zip(files, results, strict=True):
                if isinstance(result, InferenceError):
                    self._not_scored(path, result)
                else:
                    scored += 1
                    finished.append(path)
        for path in finished:
            _move(path, self.done)
            self._last_seen.pop(path, None)
        return scored

    def _not_scored(self, path: Path, error: InferenceError) -> None:
        if time.time() - path.stat().st_mtime < self.give_up_s:
            # A writer that paused mid-file: retry until it has been quiet for give_up_s
            # before calling the image unreadable.
            return
        self.agent.counters["watch.failed"] += 1
        log.error("cannot score %s: %s", path.name, error)
        _move(path, self.failed)
        self._last_seen.pop(path, None)


def prune_finished(directory: Path, *, max_files: int, max_age_s: float, now: float) -> int:
    """Keep ``done/`` or ``failed/`` bounded: the newest ``max_files`` younger than the age.

    A scored image's training copy (if any) lives in the station's data set under its own
    retention; these are the inbox's leftovers, which would otherwise fill the disk.
    """
    entries = []
    for path in directory.iterdir():
        try:
            entries.append((path.stat().st_mtime, path))
        except FileNotFoundError:
            continue
    entries.sort(reverse=True)
    removed = 0
    for index, (mtime, path) in enumerate(entries):
        if index >= max_files or now - mtime > max_age_s:
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                continue
    return removed


PRUNE_EVERY_S = 60.0


STOP_CHECK_S = 0.5  # the longest one wait for events lasts: how soon a stop is seen


def watch(
    agent: EdgeAgent,
    inbox: Path,
    stop: threading.Event,
    interval_s: float = 0.1,
    *,
    events: bool = True,
) -> None:
    """Score what lands in ``inbox`` until ``stop``: on inotify's events at once, and by a
    scan every ``interval_s`` (module docstring); ``events=False`` only scans."""
    inbox.mkdir(parents=True, exist_ok=True)
    watcher = InboxWatcher(agent, inbox)
    settings = agent.settings
    last_prune = 0.0
    next_scan = time.monotonic() + interval_s
    arrivals = open_arrivals(inbox) if events else None
    try:
        while not stop.is_set():
            try:
                wait_s = min(max(0.0, next_scan - time.monotonic()), STOP_CHECK_S)
                arrivals = _arrived(watcher, arrivals, wait_s, stop)
                if time.monotonic() < next_scan or stop.is_set():
                    continue
                next_scan = time.monotonic() + interval_s
                watcher.scan_once()
                if time.monotonic() - last_prune >= PRUNE_EVERY_S:
                    last_prune = time.monotonic()
                    for directory in (watcher.done, watcher.failed):
                        agent.counters["watch.pruned"] += prune_finished(
                            directory,
                            max_files=max(settings.keep_images, 100),
                            max_age_s=max(settings.keep_days, 1.0) * 86400.0,
                            now=time.time(),
                        )
            except Exception:  # the watcher outlives any one bad file or failure
                agent.counters["watch.errors"] += 1
                log.exception("watching %s", inbox)
                stop.wait(min(interval_s, STOP_CHECK_S))  # not a hot loop on a lasting fault
    finally:
        if arrivals is not None:
            arrivals.close()


def _arrived(
    watcher: InboxWatcher,
    arrivals: DirectoryArrivals | None,
    interval_s: float,
    stop: threading.Event,
) -> DirectoryArrivals | None:
    """Wait up to ``interval_s`` for files to arrive and score them (polling: just wait);
    the watch to use next (a new one when the inbox was removed and made again)."""
    if arrivals is None:
        stop.wait(interval_s)
        return None
    arrived = arrivals.wait(interval_s)
    if arrived.names:
        watcher.agent.counters["watch.events"] += len(arrived.names)
        watcher.score_arrived(arrived.names)
    if arrived.overflowed:
        watcher.agent.counters["watch.events_lost"] += 1  # the scan that follows finds them
    if not arrived.gone:
        return arrivals
    arrivals.close()
    watcher.inbox.mkdir(parents=True, exist_ok=True)
    watcher.made_again()
    return open_arrivals(watcher.inbox)

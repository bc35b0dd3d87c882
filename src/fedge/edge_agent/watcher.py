"""Score images dropped into a watched directory, exactly once each.

A file is scored only once it has stopped changing (same size and mtime on two scans,
and older than ``settle_s``): a camera or ``cp`` writing a large image must not be caught
half-way. A file that still does not decode is retried until it has been quiet for
``give_up_s``, then moved to ``failed/``. Writers that can should still write elsewhere
and rename into the inbox.

A file's prediction is recorded with the file name as its source; a file that is still
in the inbox after a crash is moved on without scoring it again.
"""

import logging
import threading
import time
from pathlib import Path

from fedge.edge_agent.agent import EdgeAgent, ImageFile
from fedge.edge_agent.errors import InferenceError
from fedge.edge_agent.images import MAX_IMAGE_BYTES

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".pgm"})


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

    def _settled(self, path: Path) -> bool:
        stat = path.stat()
        signature = (stat.st_size, stat.st_mtime_ns)
        previous = self._last_seen.get(path)
        self._last_seen[path] = signature
        old_enough = time.time() - stat.st_mtime >= self.settle_s
        return previous == signature and old_enough

    def scan_once(self) -> int:
        self.done.mkdir(parents=True, exist_ok=True)
        self.failed.mkdir(exist_ok=True)
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

    def _score_batch(self, paths: list[Path]) -> int:
        """Score the settled files of one batch (one model call, one commit), move them on."""
        files: list[tuple[Path, ImageFile]] = []
        finished: list[Path] = []
        for path in paths:
            source = f"file:{path.name}"
            if self.agent.store.has_source(source):
                finished.append(path)  # scored before a crash; only the move was left
                continue
            try:
                if path.stat().st_size > MAX_IMAGE_BYTES:
                    raise InferenceError(f"{path.name} is larger than {MAX_IMAGE_BYTES} bytes")
                files.append((path, ImageFile(path.read_bytes(), path.suffix, source)))
            except InferenceError as exc:
                self._not_scored(path, exc)
            except FileNotFoundError:
                continue
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
            path.replace(self.done / path.name)
            self._last_seen.pop(path, None)
        return scored

    def _not_scored(self, path: Path, error: InferenceError) -> None:
        if time.time() - path.stat().st_mtime < self.give_up_s:
            # A writer that paused mid-file: retry until it has been quiet for give_up_s
            # before calling the image unreadable.
            return
        self.agent.counters["watch.failed"] += 1
        log.error("cannot score %s: %s", path.name, error)
        path.replace(self.failed / path.name)
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


def watch(agent: EdgeAgent, inbox: Path, stop: threading.Event, interval_s: float = 0.1) -> None:
    inbox.mkdir(parents=True, exist_ok=True)
    watcher = InboxWatcher(agent, inbox)
    settings = agent.settings
    last_prune = 0.0
    while not stop.wait(interval_s):
        try:
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

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

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.errors import InferenceError
from fedge.edge_agent.images import MAX_IMAGE_BYTES

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".pgm"})


class InboxWatcher:
    def __init__(
        self, agent: EdgeAgent, inbox: Path, *, settle_s: float = 0.2, give_up_s: float = 30.0
    ) -> None:
        self.agent = agent
        self.inbox = inbox
        self.settle_s = settle_s
        self.give_up_s = give_up_s
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
        scored = 0
        present = sorted(p for p in self.inbox.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        for gone in set(self._last_seen) - set(present):
            del self._last_seen[gone]
        for path in present:
            if self.agent.model is None:
                return scored  # keep the images until a model arrives
            try:
                if not self._settled(path):
                    continue
            except FileNotFoundError:
                continue
            source = f"file:{path.name}"
            if not self.agent.store.has_source(source):
                try:
                    if path.stat().st_size > MAX_IMAGE_BYTES:
                        raise InferenceError(f"{path.name} is larger than {MAX_IMAGE_BYTES} bytes")
                    self.agent.score_image(path.read_bytes(), suffix=path.suffix, source=source)
                    scored += 1
                except InferenceError as exc:
                    if time.time() - path.stat().st_mtime < self.give_up_s:
                        # A writer that paused mid-file: retry until it has been quiet
                        # for give_up_s before calling the image unreadable.
                        continue
                    self.agent.counters["watch.failed"] += 1
                    log.error("cannot score %s: %s", path.name, exc)
                    path.replace(self.failed / path.name)
                    continue
            path.replace(self.done / path.name)
            self._last_seen.pop(path, None)
        return scored


def watch(agent: EdgeAgent, inbox: Path, stop: threading.Event, interval_s: float = 0.1) -> None:
    inbox.mkdir(parents=True, exist_ok=True)
    watcher = InboxWatcher(agent, inbox)
    while not stop.wait(interval_s):
        try:
            watcher.scan_once()
        except Exception:  # the watcher outlives any one bad file or failure
            agent.counters["watch.errors"] += 1
            log.exception("watching %s", inbox)

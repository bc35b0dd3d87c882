"""Score images dropped into a watched directory, exactly once each.

A file's prediction is recorded with the file name as its source; a file that is still
in the inbox after a crash is moved on without scoring it again.
"""

import logging
import threading
from pathlib import Path

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.errors import InferenceError
from fedge.edge_agent.images import decode_image

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".pgm"})


def scan_once(agent: EdgeAgent, inbox: Path) -> int:
    done, failed = inbox / "done", inbox / "failed"
    done.mkdir(parents=True, exist_ok=True)
    failed.mkdir(exist_ok=True)
    scored = 0
    for path in sorted(p for p in inbox.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
        source = f"file:{path.name}"
        if agent.model is None:
            return scored  # keep the images until a model arrives
        if not agent.store.has_source(source):
            try:
                agent.score(decode_image(path, agent.settings.image_size), source=source)
                scored += 1
            except InferenceError as exc:
                agent.counters["watch.failed"] += 1
                log.error("cannot score %s: %s", path.name, exc)
                path.replace(failed / path.name)
                continue
        path.replace(done / path.name)
    return scored


def watch(agent: EdgeAgent, inbox: Path, stop: threading.Event, interval_s: float = 0.1) -> None:
    inbox.mkdir(parents=True, exist_ok=True)
    while not stop.wait(interval_s):
        try:
            scan_once(agent, inbox)
        except OSError as exc:
            log.error("watching %s: %s", inbox, exc)

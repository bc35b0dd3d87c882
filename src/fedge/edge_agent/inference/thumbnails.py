"""Sharing thumbnails of scored images, when (and only when) the station's config says so.

The decision is pure (:func:`admit`: the policy, the decision and the recent sends); the
adapter (:class:`ThumbnailSharer`) makes the PNG with Pillow and queues it on the
outbox's ``thumbnails`` stream. A config without a thumbnail policy shares nothing, and
applying one drops what was still queued (``Configs.handle``): an operator who turns
sharing off stops the images that were not yet sealed into a batch.
"""

import io
import logging
import sqlite3
import threading
from collections import Counter, deque
from collections.abc import Sequence

from PIL import Image, UnidentifiedImageError

from fedge.edge_agent.store import LocalStore
from fedge.protocols.errors import ValidationError
from fedge.protocols.records import PredictionRecord, Stream
from fedge.protocols.thumbnails import (
    MAX_PNG_BYTES,
    MIN_SIDE,
    ThumbnailPolicy,
    ThumbnailRecord,
    check_png,
)

log = logging.getLogger(__name__)
WINDOW_S = 60.0


def admit(
    policy: ThumbnailPolicy | None, decision: str, recent: Sequence[float], now: float
) -> bool:
    """Whether a prediction's image is shared: a policy, the decision it covers, and
    fewer than ``per_minute`` thumbnails sent in the last minute (``recent``: send times)."""
    if policy is None:
        return False
    if policy.rejects_only and decision != "reject":
        return False
    return sum(1 for t in recent if now - t < WINDOW_S) < policy.per_minute


def make_thumbnail(data: bytes, size: int) -> bytes | None:
    """A PNG of ``data`` whose longest side is at most ``size``, within MAX_PNG_BYTES:
    grey if colour is too large, then smaller; None if nothing fits or ``data`` is no image.
    """
    try:
        with Image.open(io.BytesIO(data)) as opened:
            image = opened.convert("L" if opened.mode in ("1", "L", "I", "I;16", "F") else "RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return None
    side = size
    while side >= MIN_SIDE:
        small = image.copy()
        small.thumbnail((side, side), Image.Resampling.BILINEAR)
        for candidate in (small, small.convert("L")):
            out = io.BytesIO()
            candidate.save(out, "PNG", optimize=True)
            if out.tell() <= MAX_PNG_BYTES:
                return out.getvalue()
        side //= 2
    return None


class ThumbnailSharer:
    """Queues thumbnails of scored images as the config in force allows; thread-safe."""

    def __init__(self, store: LocalStore, counters: Counter[str]) -> None:
        self._store = store
        self.counters = counters
        self._lock = threading.Lock()
        self._sent: deque[float] = deque()

    def offer(self, policy: ThumbnailPolicy | None, record: PredictionRecord, data: bytes) -> bool:
        """Queue a thumbnail of ``data`` (the image ``record`` scored) if the policy
        admits it; True if queued. Never raises: the prediction is recorded already."""
        if policy is None:
            return False
        with self._lock:
            while self._sent and record.at - self._sent[0] >= WINDOW_S:
                self._sent.popleft()
            if not admit(policy, record.decision, self._sent, record.at):
                if policy.rejects_only is False or record.decision == "reject":
                    self.counters["thumbnails.capped"] += 1
                return False
            self._sent.append(record.at)
        png = make_thumbnail(data, policy.size)
        try:
            if png is None:
                raise ValidationError("the image could not be made into a thumbnail")
            check_png(png)
            thumbnail = ThumbnailRecord.of(record.prediction_id, record.at, png)
            self._store.add_record(Stream.THUMBNAILS, thumbnail)
        except (ValidationError, sqlite3.Error) as exc:
            self.counters["thumbnails.failed"] += 1
            log.warning("no thumbnail for %s: %s", record.prediction_id, exc)
            return False
        self.counters["thumbnails.queued"] += 1
        return True

"""Sending the agent's durable outbox: over MQTT (deleted on PUBACK) or gRPC uploads.

The outbox (:class:`~fedge.edge_agent.store.LocalStore`) holds sealed, numbered
batches; a batch is deleted only once the far side acknowledged it. Over MQTT a batch is
in flight from ``publish()`` until its PUBACK; one not acknowledged within
:data:`RESEND_AFTER_S` is sent again, and the manager stores each (edge, stream, seq)
once. A batch the far side refuses stays in the outbox, kept for inspection, and is not
retried by this process so it cannot block the batches behind it.
"""

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from fedge.edge_agent.store import LocalStore
from fedge.protocols import topics
from fedge.protocols.records import Stream
from fedge.transport.grpc.client import ReportUploader, UploadError
from fedge.transport.session import PublishResult

log = logging.getLogger(__name__)

INFLIGHT_LIMIT = 200
RESEND_AFTER_S = 60.0


def stream_topic(fleet: str, edge: str, stream: Stream) -> str:
    """The edge's up/ topic that carries ``stream``'s batches."""
    return topics.up(fleet, edge, topics.Up(stream.value))


class OutboxSender:
    """The outbox's sending side; thread-safe (publisher thread and paho's network thread)."""

    def __init__(
        self,
        store: LocalStore,
        counters: Counter[str],
        *,
        publish: Callable[[str, bytes], int],
        topic: Callable[[Stream], str],
        uploader_factory: Callable[[], ReportUploader],
    ) -> None:
        self._store = store
        self.counters = counters
        self._publish = publish
        self._topic = topic
        self._uploader_factory = uploader_factory
        self._uploader: ReportUploader | None = None
        self._inflight: dict[int, tuple[int, float]] = {}
        self._inflight_lock = threading.Lock()
        self._refused: set[int] = set()
        # The outbox publish under way and the PUBACKs that arrived during it (see drain).
        # Read and replaced only under _inflight_lock.
        self._sending_outbox = False
        self._early_acks: tuple[PublishResult, ...] = ()

    def drain(self) -> None:
        """Publish what the outbox holds and is not in flight; PUBACKs delete the batches.

        Never call into paho while holding a lock its callbacks take: paho runs
        ``on_published`` on its network thread while holding its outgoing-message mutex,
        which ``publish()`` needs too. Holding ``_inflight_lock`` across ``publish()``
        deadlocked agents draining a backlog after a broker outage (issue "A
        fault-injection and soak suite", defect 1). So ``publish()`` runs unlocked, and a
        PUBACK that comes back before it returned the mid is kept for the publisher to claim.
        """
        now = time.monotonic()
        with self._inflight_lock:
            stale = [
                mid for mid, (_, sent) in self._inflight.items() if now - sent > RESEND_AFTER_S
            ]
            for mid in stale:
                del self._inflight[mid]
            busy = {entry_id for entry_id, _ in self._inflight.values()} | self._refused
            room = INFLIGHT_LIMIT - len(self._inflight)
        if room <= 0:
            return
        for entry in self._store.outbox(room, busy):
            topic = self._topic(entry.stream)
            with self._inflight_lock:
                self._sending_outbox = True
                self._early_acks = ()
            sent: int | None = None
            try:
                sent = self._publish(topic, entry.payload)
            finally:
                early = self._end_send(entry.id, sent, now)
            if early is not None:
                self._settle(entry.id, early)

    def _end_send(self, entry_id: int, mid: int | None, sent_at: float) -> PublishResult | None:
        """Close the send window: put ``mid`` in flight, or return its PUBACK if it was early.

        Other PUBACKs kept during the window belonged to publishes outside the outbox (state
        and deploy reports); they are dropped so a reused mid cannot claim them later.
        """
        with self._inflight_lock:
            early = next((r for r in self._early_acks if r.mid == mid), None)
            self._sending_outbox = False
            self._early_acks = ()
            if mid is not None and early is None:
                self._inflight[mid] = (entry_id, sent_at)
        return early

    def upload(self) -> None:
        """Drain the outbox over gRPC: a batch is deleted once the manager stored it."""
        while entries := self._store.outbox(INFLIGHT_LIMIT, self._refused):
            try:
                if self._uploader is None:
                    self._uploader = self._uploader_factory()  # UploadError: bad TLS files
                results = self._uploader.upload([e.payload for e in entries])
            except UploadError as exc:
                self.counters["upload.failed"] += 1
                log.warning("report upload failed, will retry: %s", exc)
                return
            for entry, result in zip(entries, results, strict=True):
                if result.accepted:
                    self._store.acknowledge(entry.id)
                    self.counters["batches.acked"] += 1
                else:
                    self._refuse(entry.id, str(result.error))

    def on_published(self, result: PublishResult) -> None:
        # paho's network thread, holding paho's outgoing-message mutex: take nothing but
        # _inflight_lock, briefly, and call nothing of paho's.
        with self._inflight_lock:
            entry = self._inflight.pop(result.mid, None)
            if entry is None and self._sending_outbox:
                # Perhaps the batch being published, whose mid publish() has not returned
                # yet: the publisher claims it in _end_send.
                self._early_acks = (*self._early_acks, result)
        if entry is not None:
            self._settle(entry[0], result)

    def _settle(self, entry_id: int, result: PublishResult) -> None:
        """The broker's answer to an outbox batch: delete it, or keep it refused."""
        if result.ok:
            self._store.acknowledge(entry_id)
            self.counters["batches.acked"] += 1
        else:
            self._refuse(entry_id, result.reason)

    def _refuse(self, entry_id: int, reason: str) -> None:
        """A batch the far side refused stays in the outbox (no data is dropped on the edge)
        but is not retried by this process, so it cannot block the batches behind it."""
        with self._inflight_lock:  # the publisher reads _refused under it
            self._refused.add(entry_id)
        self.counters["batches.refused"] += 1
        log.error("outbox batch %d refused, kept for inspection: %s", entry_id, reason)

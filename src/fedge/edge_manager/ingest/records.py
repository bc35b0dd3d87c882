"""Record batches from edges (telemetry, predictions, labels, thumbnails), stored once.

A batch's (edge, stream, seq) key stores it exactly once, also after retention deleted
the key (``pruned_batches``). Each stream's sequence numbers are tracked as they arrive:
a jump opens a gap in the ``gaps`` table, a late batch fills it (gaps.py). The sequence
state is cached per (edge, stream); the caller drops the cache after a rolled-back
transaction (:meth:`RecordIngest.forget_cache`).
"""

import logging
from collections import Counter

from fedge.edge_manager.ingest import gaps
from fedge.edge_manager.ingest.checks import EnrolledEdges, Outcome, Verdict, storable
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.labels import current as labels
from fedge.protocols import codec
from fedge.protocols.errors import ValidationError
from fedge.protocols.records import (
    LabelRecord,
    MetricRecord,
    PredictionRecord,
    RecordBatch,
    Stream,
)
from fedge.protocols.thumbnails import ThumbnailRecord

log = logging.getLogger(__name__)


class RecordIngest:
    """The record-batch side of :class:`~fedge.edge_manager.ingest.messages.Ingestor`."""

    def __init__(self, counters: Counter[str], edges: EnrolledEdges, *, max_bytes: int) -> None:
        self.counters = counters
        self.max_bytes = max_bytes
        self._edges = edges
        self._seq_states: dict[tuple[str, str], gaps.SeqState] = {}

    def _seq_state(self, tx: IngestTransaction, edge: str, stream: str) -> gaps.SeqState:
        key = (edge, stream)
        state = self._seq_states.get(key)
        if state is None:
            state = self._seq_states[key] = tx.seq_state(edge, stream)
        return state

    def _key_pruned(self, tx: IngestTransaction, edge: str, stream: str, seq: int) -> bool:
        """A batch that arrived before and whose key retention deleted (retention.py)."""
        if not gaps.received(self._seq_state(tx, edge, stream), seq):
            return False  # the usual case, decided from the cached state without a query
        through = tx.pruned_through(edge, stream)
        return through is not None and seq <= through

    def forget_cache(self) -> None:
        """Drop cached sequence state (after a rolled-back transaction)."""
        self._seq_states.clear()

    def batch(
        self,
        tx: IngestTransaction,
        edge: str,
        payload: bytes,
        now: float,
        *,
        expected_stream: Stream | None,
    ) -> Outcome:
        """Store one record batch inside the caller's transaction, once per (edge, stream,
        seq); ``expected_stream`` is its topic's (``None``: it came over gRPC)."""
        batch = codec.decode(payload, RecordBatch, max_bytes=self.max_bytes)
        self._edges.check(tx, edge, batch.edge)
        # Any traffic is a sign of life (issue 15: "last seen" stayed frozen while the
        # edge sent telemetry).
        tx.seen(edge, now)
        storable(batch.seq, "seq")
        storable(batch.session, "session")
        for record in batch.records:
            if isinstance(record, PredictionRecord):
                storable(record.config_version, "config_version")
        if expected_stream is not None and batch.stream is not expected_stream:
            raise ValidationError(
                f"a {batch.stream.value} batch on the {expected_stream.value} topic"
            )
        stream = batch.stream.value
        inserted = False
        if not self._key_pruned(tx, edge, stream, batch.seq):
            inserted = tx.add_batch_key(edge, batch, now)
        if not inserted:
            tx.count_duplicate(edge, stream)
            self.counters["duplicate.batch"] += 1
            return Outcome(Verdict.DUPLICATE)
        self._track_seq(tx, edge, stream, batch.seq, now)
        records = batch.records
        if batch.stream is Stream.TELEMETRY:
            tx.add_telemetry(edge, batch.seq, [r for r in records if isinstance(r, MetricRecord)])
        elif batch.stream is Stream.PREDICTIONS:
            tx.add_predictions(
                edge, batch.seq, [r for r in records if isinstance(r, PredictionRecord)]
            )
        elif batch.stream is Stream.THUMBNAILS:
            thumbs = [r for r in records if isinstance(r, ThumbnailRecord)]
            kept = tx.add_thumbnails(edge, thumbs, now)
            if kept.withheld:  # the station's config does not share images: none kept
                self.counters["thumbnails.withheld"] += kept.withheld
                log.warning("%s sent %d thumbnails it is not set to share", edge, kept.withheld)
            self.counters[f"stored.{stream}"] += kept.stored
            return Outcome(Verdict.STORED)
        else:
            # One current label per prediction, the newest `at` winning (labels.py).
            for r in records:
                if isinstance(r, LabelRecord):
                    tx.apply_label(labels.Label.reported(r, edge), now)
        self.counters[f"stored.{stream}"] += len(records)
        return Outcome(Verdict.STORED)

    def _track_seq(
        self, tx: IngestTransaction, edge: str, stream: str, seq: int, now: float
    ) -> None:
        observation = gaps.observe(self._seq_state(tx, edge, stream), seq)
        self._seq_states[(edge, stream)] = observation.state
        tx.stream_seen(edge, stream, observation.state.max_seq)
        if observation.opened:
            low, high = observation.opened
            log.warning("gap on %s/%s: seq %d..%d missing", edge, stream, low, high)
        if observation.opened or observation.filled:
            tx.replace_gaps(edge, stream, observation.state.gaps, now)

"""Record batches from edges (telemetry, predictions, labels, thumbnails), stored once.

A batch's (edge, stream, seq) key stores it exactly once, also after retention deleted
the key (``pruned_batches``). Each stream's sequence numbers are tracked as they arrive:
a jump opens a gap in the ``gaps`` table, a late batch fills it (gaps.py). The sequence
state is cached per (edge, stream); the caller drops the cache after a rolled-back
transaction (:meth:`RecordIngest.forget_cache`).
"""

import json
import logging
import sqlite3
from collections import Counter

from fedge.edge_manager import gaps, labels, thumbnail_store
from fedge.edge_manager.ingest_checks import EnrolledEdges, Outcome, Verdict, storable
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
    """The record-batch side of :class:`~fedge.edge_manager.ingest.Ingestor`."""

    def __init__(self, counters: Counter[str], edges: EnrolledEdges, *, max_bytes: int) -> None:
        self.counters = counters
        self.max_bytes = max_bytes
        self._edges = edges
        self._seq_states: dict[tuple[str, str], gaps.SeqState] = {}

    def _seq_state(self, conn: sqlite3.Connection, edge: str, stream: str) -> gaps.SeqState:
        key = (edge, stream)
        state = self._seq_states.get(key)
        if state is None:
            row = conn.execute(
                "SELECT max_seq FROM streams WHERE edge=? AND stream=?", (edge, stream)
            ).fetchone()
            open_gaps = conn.execute(
                "SELECT from_seq, to_seq FROM gaps WHERE edge=? AND stream=? ORDER BY from_seq",
                (edge, stream),
            ).fetchall()
            state = gaps.SeqState(
                -1 if row is None else int(row[0]), tuple((int(a), int(b)) for a, b in open_gaps)
            )
            self._seq_states[key] = state
        return state

    def _key_pruned(self, conn: sqlite3.Connection, edge: str, stream: str, seq: int) -> bool:
        """A batch that arrived before and whose key retention deleted (retention.py)."""
        if not gaps.received(self._seq_state(conn, edge, stream), seq):
            return False  # the usual case, decided from the cached state without a query
        row = conn.execute(
            "SELECT through_seq FROM pruned_batches WHERE edge=? AND stream=?", (edge, stream)
        ).fetchone()
        return row is not None and seq <= int(row[0])

    def forget_cache(self) -> None:
        """Drop cached sequence state (after a rolled-back transaction)."""
        self._seq_states.clear()

    def batch(
        self,
        conn: sqlite3.Connection,
        edge: str,
        payload: bytes,
        now: float,
        *,
        expected_stream: Stream | None,
    ) -> Outcome:
        """Store one record batch inside the caller's transaction, once per (edge, stream,
        seq); ``expected_stream`` is its topic's (``None``: it came over gRPC)."""
        batch = codec.decode(payload, RecordBatch, max_bytes=self.max_bytes)
        self._edges.check(conn, edge, batch.edge)
        # Any traffic is a sign of life (issue 15: "last seen" stayed frozen while the
        # edge sent telemetry); max(): a batch delayed in a queue does not move it back.
        conn.execute(
            "UPDATE edges SET last_seen=max(coalesce(last_seen, 0), ?) WHERE edge=?", (now, edge)
        )
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
        if not self._key_pruned(conn, edge, stream, batch.seq):
            added = conn.execute(
                "INSERT OR IGNORE INTO batches (edge, stream, seq, session, n_records, "
                "received_at) VALUES (?,?,?,?,?,?)",
                (edge, stream, batch.seq, batch.session, len(batch.records), now),
            )
            inserted = added.rowcount > 0
        if not inserted:
            conn.execute(
                "UPDATE streams SET duplicates = duplicates + 1 WHERE edge=? AND stream=?",
                (edge, stream),
            )
            self.counters["duplicate.batch"] += 1
            return Outcome(Verdict.DUPLICATE)
        self._track_seq(conn, edge, stream, batch.seq, now)
        if batch.stream is Stream.TELEMETRY:
            conn.executemany(
                "INSERT INTO telemetry (edge, seq, idx, name, value, at) VALUES (?,?,?,?,?,?)",
                [
                    (edge, batch.seq, i, r.name, r.value, r.at)
                    for i, r in enumerate(batch.records)
                    if isinstance(r, MetricRecord)
                ],
            )
        elif batch.stream is Stream.PREDICTIONS:
            conn.executemany(
                "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
                "threshold, config_version, latency_ms, source, stats) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (
                        r.prediction_id,
                        edge,
                        batch.seq,
                        r.at,
                        r.model,
                        json.dumps(r.scores, sort_keys=True),
                        r.decision,
                        r.threshold,
                        r.config_version,
                        r.latency_ms,
                        r.source,
                        # '' from an agent that sends no image statistics (monitor.py)
                        "" if r.stats is None else json.dumps(r.stats, sort_keys=True),
                    )
                    for r in batch.records
                    if isinstance(r, PredictionRecord)
                ],
            )
        elif batch.stream is Stream.THUMBNAILS:
            thumbs = [r for r in batch.records if isinstance(r, ThumbnailRecord)]
            kept = thumbnail_store.store(conn, edge, thumbs, now)
            if kept.withheld:  # the station's config does not share images: none kept
                self.counters["thumbnails.withheld"] += kept.withheld
                log.warning("%s sent %d thumbnails it is not set to share", edge, kept.withheld)
            self.counters[f"stored.{stream}"] += kept.stored
            return Outcome(Verdict.STORED)
        else:
            # One current label per prediction, the newest `at` winning (labels.py).
            for r in batch.records:
                if isinstance(r, LabelRecord):
                    labels.apply(conn, labels.Label.reported(r, edge), now)
        self.counters[f"stored.{stream}"] += len(batch.records)
        return Outcome(Verdict.STORED)

    def _track_seq(
        self, conn: sqlite3.Connection, edge: str, stream: str, seq: int, now: float
    ) -> None:
        observation = gaps.observe(self._seq_state(conn, edge, stream), seq)
        self._seq_states[(edge, stream)] = observation.state
        conn.execute(
            "INSERT INTO streams (edge, stream, max_seq, batches) VALUES (?,?,?,1) "
            "ON CONFLICT (edge, stream) DO UPDATE SET max_seq=excluded.max_seq, "
            "batches=batches+1",
            (edge, stream, observation.state.max_seq),
        )
        if observation.opened:
            low, high = observation.opened
            log.warning("gap on %s/%s: seq %d..%d missing", edge, stream, low, high)
        if observation.opened or observation.filled:
            # Few gaps per stream: rewriting them is simpler than editing ranges in SQL.
            first_seen = dict(
                conn.execute(
                    "SELECT to_seq, detected_at FROM gaps WHERE edge=? AND stream=?",
                    (edge, stream),
                ).fetchall()
            )
            conn.execute("DELETE FROM gaps WHERE edge=? AND stream=?", (edge, stream))
            conn.executemany(
                "INSERT INTO gaps (edge, stream, from_seq, to_seq, detected_at) VALUES (?,?,?,?,?)",
                [
                    (edge, stream, low, high, first_seen.get(high, now))
                    for low, high in observation.state.gaps
                ],
            )

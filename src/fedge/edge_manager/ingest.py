"""Everything edges send up, stored exactly once: records, liveness, reports.

The caller (the serve loop's single writer thread) opens one transaction for many
messages and acks them to the broker only after it commits, so a crash between the two
means redelivery, never loss; redelivery is then absorbed by the (edge, stream, seq) key.

Bad input never raises out of :meth:`Ingestor.handle`: it is logged, counted, recorded in
the ``rejections`` table and leaves every other table untouched.
"""

import json
import logging
import sqlite3
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from fedge.edge_manager import evaluations, gaps, labels, thumbnail_store
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport, ConfigStatus
from fedge.protocols.deployment import DeployStage, DeployStatus
from fedge.protocols.errors import ProtocolError, ValidationError
from fedge.protocols.evaluation import EvaluationReport
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.protocols.records import (
    LabelRecord,
    MetricRecord,
    PredictionRecord,
    RecordBatch,
    Stream,
)
from fedge.protocols.thumbnails import ThumbnailRecord
from fedge.protocols.trust import TrustReport

log = logging.getLogger(__name__)
SQLITE_INT_MAX = 2**63 - 1
# The retained up/ topics whose documents may also come over gRPC (DesiredSync.Report).
STATUS_KINDS = topics.STATUS


class Verdict(StrEnum):
    STORED = "stored"
    DUPLICATE = "duplicate"
    IGNORED = "ignored"  # valid but stale (e.g. a will from an older session)
    REJECTED = "rejected"


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    reason: str = ""
    detail: str = ""


class Ingestor:
    def __init__(self, store: Store, fleet: str, *, max_bytes: int = codec.DEFAULT_MAX_BYTES):
        self.store = store
        self.fleet = fleet
        self.max_bytes = max_bytes
        self.counters: Counter[str] = Counter()
        self._seq_states: dict[tuple[str, str], gaps.SeqState] = {}
        self._known_edges: set[str] = set()

    # -- entry points

    def handle(self, conn: sqlite3.Connection, topic: str, payload: bytes, now: float) -> Outcome:
        """Ingest one MQTT message inside the caller's transaction."""
        try:
            parsed = topics.parse(topic)
            if parsed.fleet != self.fleet or parsed.direction is not topics.Direction.UP:
                raise ValidationError(f"topic {topic!r} is not an up-topic of fleet {self.fleet}")
            return self._dispatch(conn, parsed.edge, topics.Up(parsed.kind), payload, now)
        except ProtocolError as exc:
            edge = topic.split("/")[3] if topic.count("/") >= 5 else ""
            return self._reject(conn, edge, topic, exc, now)

    def handle_upload(
        self, conn: sqlite3.Connection, edge: str, payload: bytes, now: float
    ) -> Outcome:
        """A record batch that came over gRPC instead of MQTT (same bytes, same rules)."""
        try:
            return self._records(conn, edge, payload, now, expected_stream=None)
        except ProtocolError as exc:
            return self._reject(conn, edge, f"grpc:{edge}", exc, now)

    def handle_status(
        self, conn: sqlite3.Connection, edge: str, kind: topics.Up, payload: bytes, now: float
    ) -> Outcome:
        """A liveness, config or deploy report that came over gRPC instead of its up/ topic
        (issue 9: a station whose MQTT is blocked); same bytes, same code, same rules."""
        where = f"grpc:{edge}/{kind.value}"
        try:
            if kind not in STATUS_KINDS:
                raise ValidationError(f"{kind.value} is not a status document")
            return self._dispatch(conn, edge, kind, payload, now)
        except ProtocolError as exc:
            return self._reject(conn, edge, where, exc, now)

    # -- dispatch

    def _dispatch(
        self, conn: sqlite3.Connection, edge: str, kind: topics.Up, payload: bytes, now: float
    ) -> Outcome:
        if kind is topics.Up.STATE:
            return self._liveness(conn, edge, payload, now)
        if kind is topics.Up.CONFIG:
            return self._config_report(conn, edge, payload, now)
        if kind is topics.Up.DEPLOY:
            return self._deploy_status(conn, edge, payload, now)
        if kind is topics.Up.EVALUATE:
            return self._evaluation_report(conn, edge, payload, now)
        if kind is topics.Up.TRUST:
            return self._trust_report(conn, edge, payload, now)
        return self._records(conn, edge, payload, now, expected_stream=Stream(kind.value))

    @staticmethod
    def _storable(value: int, what: str) -> None:
        # The wire allows u64; SQLite's INTEGER is signed 64-bit. An agent needs 2^63
        # batches to get there, so a larger value is bad input, not data.
        if value > SQLITE_INT_MAX:
            raise ValidationError(f"{what} {value} is beyond what this manager stores (2^63-1)")

    def _check_edge(self, conn: sqlite3.Connection, topic_edge: str, message_edge: str) -> None:
        if message_edge != topic_edge:
            raise ValidationError(
                f"message says edge {message_edge!r} but came from {topic_edge!r}"
            )
        if topic_edge not in self._known_edges:
            if conn.execute("SELECT 1 FROM edges WHERE edge=?", (topic_edge,)).fetchone() is None:
                raise ValidationError(f"edge {topic_edge!r} is not enrolled")
            self._known_edges.add(topic_edge)

    def _reject(
        self, conn: sqlite3.Connection, edge: str, where: str, exc: ProtocolError, now: float
    ) -> Outcome:
        self.counters[f"rejected.{exc.reason}"] += 1
        detail = str(exc)[:500]
        log.warning("rejected message on %s: %s", where[:120], detail)
        conn.execute(
            "INSERT INTO rejections (at, edge, topic, reason, detail) VALUES (?,?,?,?,?)",
            (now, edge[:64], where[:200], exc.reason, detail),
        )
        return Outcome(Verdict.REJECTED, exc.reason, detail)

    # -- liveness and reports

    def _liveness(self, conn: sqlite3.Connection, edge: str, payload: bytes, now: float) -> Outcome:
        message = codec.decode(payload, Liveness, max_bytes=self.max_bytes)
        self._check_edge(conn, edge, message.edge)
        self._storable(message.session, "session")
        self._storable(message.applied_config_version, "applied_config_version")
        row = conn.execute("SELECT session FROM edges WHERE edge=?", (edge,)).fetchone()
        current_session = int(row[0])
        if message.state is EdgeState.ONLINE:
            stale = message.session < current_session
        else:
            # A will or goodbye only counts for the session it belongs to: a late will must
            # not mark an edge lost that already came back with a newer birth.
            stale = message.session != current_session
        if stale:
            self.counters["ignored.stale_liveness"] += 1
            return Outcome(Verdict.IGNORED, "stale", f"session {message.session} < current")
        if message.state is EdgeState.ONLINE:
            conn.execute(
                "UPDATE edges SET state=?, session=?, last_seen=?, agent_version=?, serving=?, "
                "config_applied=max(config_applied, ?) WHERE edge=?",
                (
                    message.state.value,
                    message.session,
                    now,
                    message.agent_version,
                    message.serving,
                    message.applied_config_version,
                    edge,
                ),
            )
        else:
            conn.execute(
                "UPDATE edges SET state=?, last_seen=? WHERE edge=?",
                (message.state.value, now, edge),
            )
        self.counters["stored.liveness"] += 1
        return Outcome(Verdict.STORED)

    def _trust_report(
        self, conn: sqlite3.Connection, edge: str, payload: bytes, now: float
    ) -> Outcome:
        """The manager key an edge trusts, or a rotation it refused (key_rotation.py)."""
        report = codec.decode(payload, TrustReport, max_bytes=self.max_bytes)
        self._check_edge(conn, edge, report.edge)
        self._storable(report.sequence, "sequence")
        conn.execute(
            "INSERT INTO edge_trust (edge, status, key_id, sequence, reason, reported_at) "
            "VALUES (?,?,?,?,?,?) ON CONFLICT (edge) DO UPDATE SET status=excluded.status, "
            "key_id=excluded.key_id, sequence=excluded.sequence, reason=excluded.reason, "
            "reported_at=excluded.reported_at",
            (edge, report.status.value, report.key_id, report.sequence, report.reason, now),
        )
        self.counters[f"stored.trust_{report.status.value}"] += 1
        return Outcome(Verdict.STORED)

    def _config_report(
        self, conn: sqlite3.Connection, edge: str, payload: bytes, now: float
    ) -> Outcome:
        report = codec.decode(payload, ConfigReport, max_bytes=self.max_bytes)
        self._check_edge(conn, edge, report.edge)
        self._storable(report.applied_version, "applied_version")
        self._storable(report.offered_version, "offered_version")
        conn.execute(
            "UPDATE edges SET config_applied=max(config_applied, ?), config_status=?, "
            "config_reason=?, config_reported_at=?, last_seen=? WHERE edge=?",
            (
                report.applied_version,
                f"{report.status.value}:{report.offered_version}",
                report.reason if report.status is ConfigStatus.REJECTED else "",
                now,
                now,
                edge,
            ),
        )
        self.counters["stored.config_report"] += 1
        return Outcome(Verdict.STORED)

    def _deploy_status(
        self, conn: sqlite3.Connection, edge: str, payload: bytes, now: float
    ) -> Outcome:
        status = codec.decode(payload, DeployStatus, max_bytes=self.max_bytes)
        self._check_edge(conn, edge, status.edge)
        self._storable(status.version, "version")
        self._storable(status.model_version, "model_version")
        conn.execute(
            "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
            "VALUES (?,?,?,?,?,?)",
            (edge, status.deployment_id, status.stage.value, status.reason, status.serving, now),
        )
        # A passed probation is an event of the deployment (deploy_events); the edge's
        # deployment stays ``active`` for everything that waits on that stage.
        stage = DeployStage.ACTIVE if status.stage is DeployStage.PASSED else status.stage
        conn.execute(
            "UPDATE edges SET deploy_id=?, deploy_stage=?, deploy_reason=?, serving=?, "
            "last_seen=? WHERE edge=?",
            (status.deployment_id, stage.value, status.reason, status.serving, now, edge),
        )
        self.counters["stored.deploy_status"] += 1
        return Outcome(Verdict.STORED)

    def _evaluation_report(
        self, conn: sqlite3.Connection, edge: str, payload: bytes, now: float
    ) -> Outcome:
        """A station's answer to the gate (edge_manager/evaluations.py), stored once."""
        report = codec.decode(payload, EvaluationReport, max_bytes=self.max_bytes)
        self._check_edge(conn, edge, report.edge)
        self._storable(report.version, "version")
        if not evaluations.store_report(conn, edge, report, now):
            self.counters["duplicate.evaluation_report"] += 1
            return Outcome(Verdict.DUPLICATE)
        self.counters["stored.evaluation_report"] += 1
        return Outcome(Verdict.STORED)

    # -- record batches

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

    def _records(
        self,
        conn: sqlite3.Connection,
        edge: str,
        payload: bytes,
        now: float,
        *,
        expected_stream: Stream | None,
    ) -> Outcome:
        batch = codec.decode(payload, RecordBatch, max_bytes=self.max_bytes)
        self._check_edge(conn, edge, batch.edge)
        # Any traffic is a sign of life (issue 15: "last seen" stayed frozen while the
        # edge sent telemetry); max(): a batch delayed in a queue does not move it back.
        conn.execute(
            "UPDATE edges SET last_seen=max(coalesce(last_seen, 0), ?) WHERE edge=?", (now, edge)
        )
        self._storable(batch.seq, "seq")
        self._storable(batch.session, "session")
        for record in batch.records:
            if isinstance(record, PredictionRecord):
                self._storable(record.config_version, "config_version")
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

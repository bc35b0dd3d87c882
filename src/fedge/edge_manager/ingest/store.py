"""Every write ingest makes, as methods of one transaction: the SQL of ingest lives here.

Ingest (ingest.py, ingest_records.py) decides what a message means; this module is the
storage side it calls, so no SQLite connection, cursor or row reaches ingest. An
:class:`IngestTransaction` wraps a connection inside a transaction the caller opened (the
serve loop's writer thread batches many messages into one, and ``savepoint`` isolates
each message), or opens one itself (:meth:`IngestTransaction.open`).
"""

import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from fedge.edge_manager.gate import reports as evaluations
from fedge.edge_manager.ingest import gaps, thumbnail_store
from fedge.edge_manager.labels import current as labels
from fedge.edge_manager.store import Store
from fedge.protocols.config import ConfigReport, ConfigStatus
from fedge.protocols.deployment import DeployStage, DeployStatus
from fedge.protocols.evaluation import EvaluationReport
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.protocols.records import MetricRecord, PredictionRecord, RecordBatch
from fedge.protocols.thumbnails import ThumbnailRecord
from fedge.protocols.trust import TrustReport


class IngestTransaction:
    """Ingest's writes and the few reads they depend on, inside one open transaction."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    @classmethod
    @contextmanager
    def open(cls, store: Store, immediate: bool = True) -> Iterator["IngestTransaction"]:
        """A transaction of its own on ``store`` (committed on exit, rolled back on error)."""
        with store.transaction(immediate) as conn:
            yield cls(conn)

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """One message's writes: undone alone if it raises (the exception propagates)."""
        self._conn.execute("SAVEPOINT message")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK TO message")
            raise
        finally:
            self._conn.execute("RELEASE message")

    # -- edges and their status documents

    def is_enrolled(self, edge: str) -> bool:
        row = self._conn.execute("SELECT 1 FROM edges WHERE edge=?", (edge,)).fetchone()
        return row is not None

    def session_of(self, edge: str) -> int:
        row = self._conn.execute("SELECT session FROM edges WHERE edge=?", (edge,)).fetchone()
        return int(row[0])

    def went_online(self, edge: str, birth: Liveness, now: float) -> None:
        self._conn.execute(
            "UPDATE edges SET state=?, session=?, last_seen=?, agent_version=?, serving=?, "
            "config_applied=max(config_applied, ?), images_at=? WHERE edge=?",
            (
                birth.state.value,
                birth.session,
                now,
                birth.agent_version,
                birth.serving,
                birth.applied_config_version,
                birth.images_at or "",
                edge,
            ),
        )

    def changed_state(self, edge: str, state: EdgeState, now: float) -> None:
        self._conn.execute(
            "UPDATE edges SET state=?, last_seen=? WHERE edge=?", (state.value, now, edge)
        )

    def seen(self, edge: str, now: float) -> None:
        """Any traffic is a sign of life; max(): a message delayed in a queue does not
        move "last seen" back. Records from an edge stored ``lost`` bring it back online:
        an agent from before heartbeats (fleet/liveness.py) sends no birth between its
        reports, so silence marked it lost while it was only quiet; the broker delivers
        what a session sent before its last will ahead of the will, so a record after
        a will is a new session's."""
        self._conn.execute(
            "UPDATE edges SET last_seen=max(coalesce(last_seen, 0), ?), "
            "state=CASE WHEN state='lost' THEN 'online' ELSE state END WHERE edge=?",
            (now, edge),
        )

    def config_report(self, edge: str, report: ConfigReport, now: float) -> None:
        self._conn.execute(
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

    def deploy_status(
        self, edge: str, status: DeployStatus, stage: DeployStage, now: float
    ) -> None:
        """The report as an event of its deployment, and ``stage`` as the edge's own."""
        self._conn.execute(
            "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
            "VALUES (?,?,?,?,?,?)",
            (edge, status.deployment_id, status.stage.value, status.reason, status.serving, now),
        )
        self._conn.execute(
            "UPDATE edges SET deploy_id=?, deploy_stage=?, deploy_reason=?, serving=?, "
            "last_seen=? WHERE edge=?",
            (status.deployment_id, stage.value, status.reason, status.serving, now, edge),
        )

    def trust_report(self, edge: str, report: TrustReport, now: float) -> None:
        self._conn.execute(
            "INSERT INTO edge_trust (edge, status, key_id, sequence, reason, reported_at) "
            "VALUES (?,?,?,?,?,?) ON CONFLICT (edge) DO UPDATE SET status=excluded.status, "
            "key_id=excluded.key_id, sequence=excluded.sequence, reason=excluded.reason, "
            "reported_at=excluded.reported_at",
            (edge, report.status.value, report.key_id, report.sequence, report.reason, now),
        )

    def evaluation_report(self, edge: str, report: EvaluationReport, now: float) -> bool:
        """Stored once (evaluations.py); False if it was stored before."""
        return evaluations.store_report(self._conn, edge, report, now)

    def rejection(self, now: float, edge: str, where: str, reason: str, detail: str) -> None:
        self._conn.execute(
            "INSERT INTO rejections (at, edge, topic, reason, detail) VALUES (?,?,?,?,?)",
            (now, edge[:64], where[:200], reason, detail),
        )

    # -- record batches

    def seq_state(self, edge: str, stream: str) -> gaps.SeqState:
        row = self._conn.execute(
            "SELECT max_seq FROM streams WHERE edge=? AND stream=?", (edge, stream)
        ).fetchone()
        open_gaps = self._conn.execute(
            "SELECT from_seq, to_seq FROM gaps WHERE edge=? AND stream=? ORDER BY from_seq",
            (edge, stream),
        ).fetchall()
        return gaps.SeqState(
            -1 if row is None else int(row[0]), tuple((int(a), int(b)) for a, b in open_gaps)
        )

    def pruned_through(self, edge: str, stream: str) -> int | None:
        """The highest seq of the stream whose batch key retention deleted (retention.py)."""
        row = self._conn.execute(
            "SELECT through_seq FROM pruned_batches WHERE edge=? AND stream=?", (edge, stream)
        ).fetchone()
        return None if row is None else int(row[0])

    def add_batch_key(self, edge: str, batch: RecordBatch, now: float) -> bool:
        """The batch's (edge, stream, seq) key; False if it was stored before."""
        added = self._conn.execute(
            "INSERT OR IGNORE INTO batches (edge, stream, seq, session, n_records, "
            "received_at) VALUES (?,?,?,?,?,?)",
            (edge, batch.stream.value, batch.seq, batch.session, len(batch.records), now),
        )
        return added.rowcount > 0

    def count_duplicate(self, edge: str, stream: str) -> None:
        self._conn.execute(
            "UPDATE streams SET duplicates = duplicates + 1 WHERE edge=? AND stream=?",
            (edge, stream),
        )

    def stream_seen(self, edge: str, stream: str, max_seq: int) -> None:
        self._conn.execute(
            "INSERT INTO streams (edge, stream, max_seq, batches) VALUES (?,?,?,1) "
            "ON CONFLICT (edge, stream) DO UPDATE SET max_seq=excluded.max_seq, "
            "batches=batches+1",
            (edge, stream, max_seq),
        )

    def replace_gaps(
        self, edge: str, stream: str, open_gaps: Sequence[tuple[int, int]], now: float
    ) -> None:
        """The stream's open gaps are now ``open_gaps``; each keeps when it was first seen.

        Few gaps per stream: rewriting them is simpler than editing ranges in SQL.
        """
        first_seen = dict(
            self._conn.execute(
                "SELECT to_seq, detected_at FROM gaps WHERE edge=? AND stream=?", (edge, stream)
            ).fetchall()
        )
        self._conn.execute("DELETE FROM gaps WHERE edge=? AND stream=?", (edge, stream))
        self._conn.executemany(
            "INSERT INTO gaps (edge, stream, from_seq, to_seq, detected_at) VALUES (?,?,?,?,?)",
            [(edge, stream, low, high, first_seen.get(high, now)) for low, high in open_gaps],
        )

    def add_telemetry(self, edge: str, seq: int, records: Sequence[MetricRecord]) -> None:
        self._conn.executemany(
            "INSERT INTO telemetry (edge, seq, idx, name, value, at) VALUES (?,?,?,?,?,?)",
            [(edge, seq, i, r.name, r.value, r.at) for i, r in enumerate(records)],
        )

    def add_predictions(self, edge: str, seq: int, records: Sequence[PredictionRecord]) -> None:
        self._conn.executemany(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
            "threshold, config_version, latency_ms, source, stats, anomaly_model, "
            "anomaly_score, novel, anomaly_threshold) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [
                (
                    r.prediction_id,
                    edge,
                    seq,
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
                    "" if r.anomaly is None else r.anomaly.model,
                    None if r.anomaly is None else r.anomaly.score,
                    # NULL: no verdict (no anomaly model, or no threshold in force)
                    None if r.anomaly is None or r.anomaly.threshold is None else int(r.novel),
                    None if r.anomaly is None else r.anomaly.threshold,
                )
                for r in records
            ],
        )

    def add_thumbnails(
        self, edge: str, records: Sequence[ThumbnailRecord], now: float
    ) -> thumbnail_store.Stored:
        return thumbnail_store.store(self._conn, edge, records, now)

    def apply_label(self, label: labels.Label, now: float) -> labels.Outcome:
        """Under the one-current-label rule, the newest ``at`` winning (labels.py)."""
        return labels.apply(self._conn, label, now)

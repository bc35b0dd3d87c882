"""Everything edges send up, stored exactly once: records, liveness, reports.

The caller (the serve loop's single writer thread) opens one transaction for many
messages and acks them to the broker only after it commits, so a crash between the two
means redelivery, never loss; redelivery is then absorbed by the (edge, stream, seq) key.

Bad input never raises out of :meth:`Ingestor.handle`: it is logged, counted, recorded in
the ``rejections`` table and leaves every other table untouched.

Status documents (liveness and reports) are stored here; record batches in
:mod:`fedge.edge_manager.ingest.records`.
"""

import logging
from collections import Counter

from fedge.edge_manager.ingest.checks import EnrolledEdges, storable
from fedge.edge_manager.ingest.checks import Outcome as Outcome
from fedge.edge_manager.ingest.checks import Verdict as Verdict
from fedge.edge_manager.ingest.records import RecordIngest
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport
from fedge.protocols.deployment import DeployStage, DeployStatus
from fedge.protocols.errors import ProtocolError, ValidationError
from fedge.protocols.evaluation import EvaluationReport
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.protocols.records import Stream
from fedge.protocols.trust import TrustReport

log = logging.getLogger(__name__)
# The retained up/ topics whose documents may also come over gRPC (DesiredSync.Report).
STATUS_KINDS = topics.STATUS


class Ingestor:
    def __init__(self, store: Store, fleet: str, *, max_bytes: int = codec.DEFAULT_MAX_BYTES):
        self.store = store
        self.fleet = fleet
        self.max_bytes = max_bytes
        self.counters: Counter[str] = Counter()
        self._edges = EnrolledEdges()
        self._records = RecordIngest(self.counters, self._edges, max_bytes=max_bytes)

    # -- entry points

    def handle(self, tx: IngestTransaction, topic: str, payload: bytes, now: float) -> Outcome:
        """Ingest one MQTT message inside the caller's transaction."""
        try:
            parsed = topics.parse(topic)
            if parsed.fleet != self.fleet or parsed.direction is not topics.Direction.UP:
                raise ValidationError(f"topic {topic!r} is not an up-topic of fleet {self.fleet}")
            return self._dispatch(tx, parsed.edge, topics.Up(parsed.kind), payload, now)
        except ProtocolError as exc:
            edge = topic.split("/")[3] if topic.count("/") >= 5 else ""
            return self._reject(tx, edge, topic, exc, now)

    def handle_upload(
        self, tx: IngestTransaction, edge: str, payload: bytes, now: float
    ) -> Outcome:
        """A record batch that came over gRPC instead of MQTT (same bytes, same rules)."""
        try:
            return self._records.batch(tx, edge, payload, now, expected_stream=None)
        except ProtocolError as exc:
            return self._reject(tx, edge, f"grpc:{edge}", exc, now)

    def handle_status(
        self, tx: IngestTransaction, edge: str, kind: topics.Up, payload: bytes, now: float
    ) -> Outcome:
        """A liveness, config or deploy report that came over gRPC instead of its up/ topic
        (issue 9: a station whose MQTT is blocked); same bytes, same code, same rules."""
        where = f"grpc:{edge}/{kind.value}"
        try:
            if kind not in STATUS_KINDS:
                raise ValidationError(f"{kind.value} is not a status document")
            return self._dispatch(tx, edge, kind, payload, now)
        except ProtocolError as exc:
            return self._reject(tx, edge, where, exc, now)

    # -- dispatch

    def _dispatch(
        self, tx: IngestTransaction, edge: str, kind: topics.Up, payload: bytes, now: float
    ) -> Outcome:
        if kind is topics.Up.STATE:
            return self._liveness(tx, edge, payload, now)
        if kind is topics.Up.CONFIG:
            return self._config_report(tx, edge, payload, now)
        if kind is topics.Up.DEPLOY:
            return self._deploy_status(tx, edge, payload, now)
        if kind is topics.Up.EVALUATE:
            return self._evaluation_report(tx, edge, payload, now)
        if kind is topics.Up.TRUST:
            return self._trust_report(tx, edge, payload, now)
        return self._records.batch(tx, edge, payload, now, expected_stream=Stream(kind.value))

    def forget_cache(self) -> None:
        """Drop cached sequence state (after a rolled-back transaction)."""
        self._records.forget_cache()

    def _reject(
        self, tx: IngestTransaction, edge: str, where: str, exc: ProtocolError, now: float
    ) -> Outcome:
        self.counters[f"rejected.{exc.reason}"] += 1
        detail = str(exc)[:500]
        log.warning("rejected message on %s: %s", where[:120], detail)
        tx.rejection(now, edge, where, exc.reason, detail)
        return Outcome(Verdict.REJECTED, exc.reason, detail)

    # -- liveness and reports

    def _liveness(self, tx: IngestTransaction, edge: str, payload: bytes, now: float) -> Outcome:
        message = codec.decode(payload, Liveness, max_bytes=self.max_bytes)
        self._edges.check(tx, edge, message.edge)
        storable(message.session, "session")
        storable(message.applied_config_version, "applied_config_version")
        current_session = tx.session_of(edge)
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
            tx.went_online(edge, message, now)
        else:
            tx.changed_state(edge, message.state, now)
        self.counters["stored.liveness"] += 1
        return Outcome(Verdict.STORED)

    def _trust_report(
        self, tx: IngestTransaction, edge: str, payload: bytes, now: float
    ) -> Outcome:
        """The manager key an edge trusts, or a rotation it refused (key_rotation.py)."""
        report = codec.decode(payload, TrustReport, max_bytes=self.max_bytes)
        self._edges.check(tx, edge, report.edge)
        storable(report.sequence, "sequence")
        tx.trust_report(edge, report, now)
        self.counters[f"stored.trust_{report.status.value}"] += 1
        return Outcome(Verdict.STORED)

    def _config_report(
        self, tx: IngestTransaction, edge: str, payload: bytes, now: float
    ) -> Outcome:
        report = codec.decode(payload, ConfigReport, max_bytes=self.max_bytes)
        self._edges.check(tx, edge, report.edge)
        storable(report.applied_version, "applied_version")
        storable(report.offered_version, "offered_version")
        tx.config_report(edge, report, now)
        self.counters["stored.config_report"] += 1
        return Outcome(Verdict.STORED)

    def _deploy_status(
        self, tx: IngestTransaction, edge: str, payload: bytes, now: float
    ) -> Outcome:
        status = codec.decode(payload, DeployStatus, max_bytes=self.max_bytes)
        self._edges.check(tx, edge, status.edge)
        storable(status.version, "version")
        storable(status.model_version, "model_version")
        # A passed probation is an event of the deployment (deploy_events); the edge's
        # deployment stays ``active`` for everything that waits on that stage.
        stage = DeployStage.ACTIVE if status.stage is DeployStage.PASSED else status.stage
        tx.deploy_status(edge, status, stage, now)
        self.counters["stored.deploy_status"] += 1
        return Outcome(Verdict.STORED)

    def _evaluation_report(
        self, tx: IngestTransaction, edge: str, payload: bytes, now: float
    ) -> Outcome:
        """A station's answer to the gate (edge_manager/gate/reports.py), stored once."""
        report = codec.decode(payload, EvaluationReport, max_bytes=self.max_bytes)
        self._edges.check(tx, edge, report.edge)
        storable(report.version, "version")
        if not tx.evaluation_report(edge, report, now):
            self.counters["duplicate.evaluation_report"] += 1
            return Outcome(Verdict.DUPLICATE)
        self.counters["stored.evaluation_report"] += 1
        return Outcome(Verdict.STORED)

"""``fedge manager serve``: the MQTT and gRPC adapters around the store.

One worker thread owns the write connection. Everything that changes the store -- MQTT
messages, gRPC uploads, publish acknowledgements -- is queued to it; it folds a burst of
messages into one transaction and acks them to the broker only after the commit (QoS 1
with manual acks: a SIGKILL between store and ack means redelivery, which the
(edge, stream, seq) key absorbs). The same loop publishes desired documents that
operators wrote to the store, signed and retained (desired_publisher.py).

A transaction the store refuses (a full disk, issue 33) is neither acknowledged nor
dropped: its messages are held in memory and tried again with a bounded back-off until
they are stored, and the store's state is said once each way (ingest/hold.py has the
design and why it is not "reconnect so the broker redelivers").
"""

import datetime as dt
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import grpc

from fedge.edge_manager.desired import pace
from fedge.edge_manager.desired.publisher import DesiredPublisher
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.liveness import SilenceSweep
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.grpc_reads import StoreReads
from fedge.edge_manager.home import run_dir, space
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.ingest import hold
from fedge.edge_manager.ingest.messages import Ingestor, Outcome, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.ingest.work import (
    Delivered,
    Published,
    Republish,
    Upload,
    WorkItem,
    ingest_upload,
)
from fedge.edge_manager.metrics.collector import ManagerCollector, ServeReadings, manager_registry
from fedge.edge_manager.metrics.readiness import manager_readiness
from fedge.edge_manager.monitor.tick import Monitor, policy_from
from fedge.edge_manager.retention.policy import Pruner, RetentionPolicy
from fedge.edge_manager.rollout.service import RolloutDriver
from fedge.edge_manager.security import key_rotation
from fedge.edge_manager.security.enroll_server import EnrollServer
from fedge.edge_manager.security.renewal import CredentialKeeper
from fedge.edge_manager.store import Store, StoreError, unwritable
from fedge.protocols import codec, pki, topics
from fedge.protocols.alerts import Alert
from fedge.protocols.pki import TlsFiles
from fedge.transport.errors import TransportError
from fedge.transport.grpc.contract import SinkResult
from fedge.transport.grpc.server import GrpcServices
from fedge.transport.metrics import MetricsError, MetricsServer, Readiness, ServerTlsContext
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import (
    Message,
    MqttSettings,
    Session,
    SessionFactory,
)

log = logging.getLogger(__name__)
ROLLOUT_TICK_S = 1.0
# How often the store's file system is measured (a statvfs call), and how often retention
# prunes while its space is low (instead of its interval; home/space.py).
SPACE_CHECK_S = 1.0
LOW_SPACE_PRUNE_S = 5.0


class ManagerService:
    def __init__(
        self,
        home: ManagerHome,
        *,
        poll_interval_s: float = 0.05,
        max_batch: int = 5000,
        grpc_port: int | None = None,
        grpc_tls: TlsFiles | None = None,
        sessions: SessionFactory = MqttSession,
        clock: Callable[[], dt.datetime] = pki.utcnow,
    ) -> None:
        self.home = home
        self.settings = home.settings()
        done = key_rotation.settle(home)  # a rotation a crash cut short
        if done:
            log.warning("signing key: %s", done)
        self.key = home.signing_key()
        self.poll_interval_s = poll_interval_s
        self.max_batch = max_batch
        self.grpc_port = self.settings.grpc_port if grpc_port is None else grpc_port
        # gRPC: mutual TLS with the home's server certificate and CRL (stations are their
        # certificates), unless the home is --insecure (tokens, development only).
        if grpc_tls is None and not self.settings.insecure:
            grpc_tls = home.pki().server_files("grpc")
        self.grpc_tls = grpc_tls
        self.counters: Counter[str] = Counter()
        self.pruner = Pruner(RetentionPolicy.from_settings(self.settings))
        self._rollouts_due = 0.0
        self._monitor_due = 0.0
        self._queue: queue.SimpleQueue[WorkItem] = queue.SimpleQueue()
        # Ingest held while the store refuses writes (ingest/hold.py), oldest first.
        self._held: list[WorkItem] = []
        # When the writer last found its queue empty (wall clock; 0: not yet): the
        # silence sweep judges as of then (fleet/liveness.py).
        self._taken_through = 0.0
        self._outage: hold.Outage | None = None
        self._connection = 0  # counts connections and disconnections (see Delivered)
        self.headroom = space.Headroom(self.settings.low_space_percent, self.settings.low_space_mib)
        self._space: space.DiskSpace | None = None
        self._space_due = 0.0
        self._low_since: float | None = None
        self.pacer = pace.Pacer(self.counters)
        self._serve_lock: int | None = None  # run/serve.pid, when this service took it
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._worker = threading.Thread(target=self._run, name="manager-worker", daemon=True)
        self._grpc_server: grpc.Server | None = None
        self.grpc_services: GrpcServices | None = None
        self.enroll_server: EnrollServer | None = None
        self.mqtt: Session = sessions(
            MqttSettings(
                host=self.settings.local_broker_host,
                port=self.settings.broker_port,
                client_id=self.settings.manager_user,
                # Under TLS the manager is its certificate (role manager, CN manager_user).
                username=self.settings.manager_user if self.settings.insecure else None,
                password=home.manager_password() if self.settings.insecure else None,
                tls=None if self.settings.insecure else home.pki().manager_files(),
                manual_ack=True,
                max_inflight=1000,
                receive_maximum=hold.RECEIVE_MAXIMUM,
            ),
            on_message=self._delivered,
            on_connect=self._on_connect,
            on_disconnect=self._on_disconnect,
            on_published=lambda result: self._queue.put(Published(result)),
        )
        self.publisher = DesiredPublisher(home, self.settings.fleet, self.mqtt, self.counters)
        # CRL, server and manager certificates issued again before they lapse (issue 24);
        # ``clock`` is the credentials' time (tests move it), checked hourly.
        self.credential_keeper = CredentialKeeper(
            home,
            clock=clock,
            on_manager_renewed=self.mqtt.reload_certificate,
            counters=self.counters,
        )
        # Silent online edges marked lost within seconds (fleet/liveness.py, issue 27).
        self.sweep = SilenceSweep(
            self.settings.edge_lost_after_s,
            self.counters,
            started=time.time(),
            stored_through=lambda: None if self._held else self._taken_through,
        )
        # Prometheus metrics read when scraped, in this serve's own registry (issue 27).
        self.registry = manager_registry(
            ManagerCollector(
                ServeReadings(
                    counters=lambda: self.counters,
                    ingest_counters=self._ingest_counters,
                    held=lambda: len(self._held),
                    store_state=lambda: self.store_health().state,
                    broker_connected=self.mqtt.connected.is_set,
                ),
                home.db_path,
                home.pki().root,
            )
        )
        self.metrics_server: MetricsServer | None = None

    # -- lifecycle

    def start(self, timeout_s: float = 10.0) -> None:
        space.require_writable_store(self.home.db_path)
        self._hold_serve_lock()
        self._worker.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("manager worker did not start")
        reader = StoreReads(self.home, self.settings, self.key)
        self.grpc_services = GrpcServices(
            reader, self, reader.authenticate, desired=reader, status_sink=self, tls=self.grpc_tls
        )
        self._grpc_server, self.grpc_port = self.grpc_services.start(
            self.settings.grpc_host, self.grpc_port
        )
        if not self.settings.insecure:
            # Devices with no certificate yet enrol here (server-authenticated TLS).
            # A busy port stops enrollment, not the control plane: said loudly, retried
            # at the next start.
            try:
                self.enroll_server = EnrollServer(
                    self.home, self.settings.grpc_host, self.settings.enroll_port
                )
            except OSError as exc:
                self.counters["enroll_server.unavailable"] += 1
                log.error(
                    "enrollment endpoint not started on port %s (%s); devices cannot enrol "
                    "or renew until `manager serve` restarts with the port free",
                    self.settings.enroll_port,
                    exc,
                )
            else:
                self.enroll_server.start()
        self.mqtt.start()
        self._serve_metrics()

    def _serve_metrics(self) -> None:
        """/metrics, /healthz and /readyz (metrics_port; 0: off). Like enrollment, a busy
        port or unusable TLS files stop the metrics, never the control plane."""
        host, port = self.settings.metrics_host, self.settings.metrics_port
        if port == 0:
            return
        try:
            loopback = host in ("127.0.0.1", "::1", "localhost")
            context, crl = None, None
            if not loopback and not self.settings.insecure:
                files = self.home.pki().server_files("grpc")
                # Follows the files: a renewed certificate is served without a restart.
                context, crl = ServerTlsContext(files), files.crl
            self.metrics_server = MetricsServer(
                self.registry,
                self.readiness,
                host,
                port,
                context=context,
                crl=crl,
                name="serve-metrics",
            )
        except (MetricsError, OSError, ManagerError) as exc:
            self.counters["metrics.unavailable"] += 1
            log.error("metrics not served: %s", exc)
            return
        self.metrics_server.start()
        log.info("metrics, /healthz and /readyz on %s", self.metrics_server.url)

    def readiness(self) -> Readiness:
        """``/readyz``: the broker connected, the store writable, the writer running."""
        health, link = self.store_health(), self.mqtt.link
        return manager_readiness(
            broker_connected=self.mqtt.connected.is_set(),
            broker_detail=link.last_error,
            store_state=health.state,
            store_detail=health.detail,
            worker_alive=self._worker.is_alive(),
        )

    def _ingest_counters(self) -> dict[str, int]:
        ingestor: Ingestor | None = getattr(self, "ingestor", None)
        return {} if ingestor is None else dict(ingestor.counters)

    def _hold_serve_lock(self) -> None:
        """Whether serve runs is read from its lock (run_dir.running: the console's "live",
        ``manager status``, commands' notices). ``fedge manager serve`` takes it before
        building this service; a service run in-process (tests, ``fedge bench console``)
        takes it here, so those checks are true to it too. Held by another process: left
        to it (never an error here; the CLI refuses a second serve itself)."""
        held = run_dir.running(self.home.root, run_dir.Role.SERVE)
        if held is not None and held.pid == os.getpid():
            return  # `fedge manager serve` in this process holds it
        try:
            self._serve_lock = (
                None if held is not None else run_dir.hold(self.home.root, run_dir.Role.SERVE)
            )
        except ManagerError as exc:  # taken meanwhile, or the run folder is not writable
            log.warning("serve lock not taken: %s", exc)

    def stop(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.enroll_server is not None:
            self.enroll_server.stop()
        self.mqtt.stop()
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=1.0)
        self._stop.set()
        self._worker.join(timeout=10)
        if self._serve_lock is not None:
            os.close(self._serve_lock)
            self._serve_lock = None

    def _delivered(self, message: Message) -> None:
        self._queue.put(Delivered(message, self._connection))

    def _on_disconnect(self, reason: str) -> None:
        self._connection += 1  # only paho's thread writes it

    def _on_connect(self, session_present: bool) -> None:
        self._connection += 1
        self.mqtt.subscribe(topics.fleet_up_subscription(self.settings.fleet), qos=1)
        if not session_present:
            # The broker may have lost retained documents (a wiped store): publish the
            # latest again; edges ignore versions they already applied.
            self._queue.put(Republish())

    # -- gRPC ReportSink (called on gRPC threads)

    def ingest_payload(self, edge: str, payload: bytes) -> SinkResult:
        future: Future[Outcome] = Future()
        self._queue.put(Upload(edge, payload, future))
        outcome = future.result(timeout=30)
        return SinkResult(
            accepted=outcome.verdict in (Verdict.STORED, Verdict.DUPLICATE),
            duplicate=outcome.verdict is Verdict.DUPLICATE,
            error=outcome.detail or None if outcome.verdict is Verdict.REJECTED else None,
        )

    # -- gRPC StatusSink (called on gRPC threads): an edge's up/ statuses without MQTT

    def ingest_status(self, edge: str, kind: str, payload: bytes) -> SinkResult:
        future: Future[Outcome] = Future()
        self._queue.put(Upload(edge, payload, future, topics.Up(kind)))
        outcome = future.result(timeout=30)
        # A stale liveness (IGNORED) is no error: the edge need not send it again.
        rejected = outcome.verdict is Verdict.REJECTED
        return SinkResult(accepted=not rejected, error=outcome.detail or None if rejected else None)

    # -- the worker

    def _run(self) -> None:
        fleet = Fleet.open(self.home)
        store = fleet.store
        ingestor = Ingestor(store, self.settings.fleet)
        self.ingestor = ingestor
        rollouts = RolloutDriver(fleet)  # staged rollouts step here, on the one writer
        monitor = Monitor(
            store,
            self.settings.fleet,
            policy_from(self.settings.monitor_min_window, self.settings.min_estimated_accuracy),
        )
        self.monitor = monitor
        self._ready.set()
        try:
            while not self._stop.is_set():
                self._ingest(store, fleet, ingestor, self._drain())
                self._check_space()
                if self._outage is not None:
                    # Every tick below writes the store: they wait for it with ingest
                    # (and would only log the same failure again and again).
                    continue
                self.pacer.tick(fleet, self._low_since is not None, self._space, time.time())
                self._drive_rollouts(rollouts)
                if self.publisher.follow_key(fleet):
                    self.key = fleet.key
                self.publisher.publish_pending(fleet)
                self._prune(store)
                self._watch(monitor)
                self.sweep.tick(store, time.time())
                self.credential_keeper.tick()
        finally:
            store.close()

    def _drain(self) -> list[WorkItem]:
        items: list[WorkItem] = []
        try:
            asked = time.time()
            items.append(self._queue.get(timeout=self.poll_interval_s))
            while len(items) < self.max_batch:
                asked = time.time()
                items.append(self._queue.get_nowait())
        except queue.Empty:
            # Everything received before ``asked`` is in ``items``, stored before the
            # sweep runs (fleet/liveness.py judges silence as of this moment).
            self._taken_through = asked
        return items

    # -- ingest, and what it does while the store refuses writes (ingest/hold.py)

    def store_health(self) -> space.StoreHealth:
        """The store as serve sees it now (read on other threads: plain attribute reads)."""
        outage, measured, held = self._outage, self._space, len(self._held)
        free = None if measured is None else measured.free_bytes
        if outage is not None:
            return space.StoreHealth("unwritable", outage.error, free, held, outage.since)
        if measured is not None and self._low_since is not None:
            return space.StoreHealth(
                "low", space.low_line(measured, self.headroom), free, held, self._low_since
            )
        return space.StoreHealth("ok", "", free, held, None)

    def _ingest(
        self, store: Store, fleet: Fleet, ingestor: Ingestor, items: list[WorkItem]
    ) -> None:
        """Store ``items`` behind whatever is held, in chunks of ``max_batch``; what a
        refused transaction held waits for the back-off (uploads are refused at once:
        their stations keep them and send them again)."""
        outage = self._outage
        if outage is not None and not hold.retry_due(outage, time.time()):
            for item in items:
                if isinstance(item, Upload):
                    refused = f"the manager's store is unwritable ({outage.error}); send it again"
                    item.result.set_exception(hold.StoreUnwritableError(refused))
                else:
                    self._held.append(item)
            return
        pending, self._held = self._held + items, []
        waited = len(pending)
        while pending:
            chunk, pending = pending[: self.max_batch], pending[self.max_batch :]
            error = self._process(store, fleet, ingestor, chunk)
            if error is not None:
                kept: list[WorkItem] = [i for i in chunk if not isinstance(i, Upload)]
                self._held = kept + pending
                self._refused(store, error, time.time())
                return
        if self._outage is not None:
            log.warning("%s", hold.recovered_line(self._outage, time.time(), waited))
            self.counters["store.recovered"] += 1
            self._outage = None

    def _refused(self, store: Store, error: str, now: float) -> None:
        """Note one refused transaction: said once per outage, counted every time."""
        self.counters["store.refused"] += 1
        if self._outage is None:
            measured = space.measure(Path(store.path))
            self._space = measured or self._space
            log.error("%s", hold.unwritable_line(error, str(store.path), measured))
        self._outage = hold.failed(self._outage, now, error)

    def _check_space(self) -> None:
        """Measure the store's file system about once a second; say once when it becomes
        low (and prune early while it is) and once when it is not any more."""
        now = time.time()
        if now < self._space_due:
            return
        self._space_due = now + SPACE_CHECK_S
        measured = space.measure(self.home.db_path)
        self._space = measured
        if measured is None:
            return
        low = self.headroom.low(measured)
        if low and self._low_since is None:
            self._low_since = now
            self.counters["store.low_space"] += 1
            log.warning("%s", space.low_line(measured, self.headroom))
        elif not low and self._low_since is not None:
            self._low_since = None
            log.info("store space no longer low: %s", space.describe_space(measured))
        if low:
            self.pruner.hurry(now, LOW_SPACE_PRUNE_S)

    def _process(
        self, store: Store, fleet: Fleet, ingestor: Ingestor, items: list[WorkItem]
    ) -> str | None:
        """One transaction for ``items``; None once committed and acknowledged, else why
        the store refused it (nothing acknowledged; uploads told)."""
        now = time.time()
        to_ack: list[Delivered] = []
        uploads: list[tuple[Upload, Outcome]] = []
        try:
            with IngestTransaction.open(store) as tx:
                for item in items:
                    if isinstance(item, Delivered):
                        message = item.message
                        handle = partial(ingestor.handle, tx, message.topic, message.payload, now)
                        outcome = self._isolated(tx, ingestor, handle)
                        self.counters[outcome.verdict.value] += 1
                        to_ack.append(item)
                    elif isinstance(item, Upload):
                        outcome = self._isolated(
                            tx, ingestor, partial(ingest_upload, ingestor, tx, item, now)
                        )
                        self.counters[outcome.verdict.value] += 1
                        uploads.append((item, outcome))
                    elif isinstance(item, Published):
                        result = item.result
                        self._isolated_step(
                            tx, ingestor, partial(self.publisher.mark_published, fleet, result, now)
                        )
                    else:
                        self._isolated_step(
                            tx, ingestor, partial(self.publisher.republish_latest, fleet)
                        )
        except Exception as exc:
            # Nothing is acked: the messages are held and tried again (the caller), and
            # the cache may hold rolled-back state.
            if not unwritable(exc):  # a refusal is said once by the caller; this is a bug
                log.exception("ingest transaction failed; its messages are held and tried again")
            ingestor.forget_cache()
            for upload in (i for i in items if isinstance(i, Upload)):
                upload.result.set_exception(exc)
            return f"{type(exc).__name__}: {exc}"
        connection = self._connection
        for item in to_ack:
            # One delivered on an earlier connection is not acked (ingest/hold.py): its
            # packet id may name another message now.
            if item.connection == connection:
                self.mqtt.ack(item.message)
            else:
                self.counters["held_across_reconnect"] += 1
        for upload, outcome in uploads:
            upload.result.set_result(outcome)
        return None

    def _isolated(
        self, tx: IngestTransaction, ingestor: Ingestor, handle: Callable[[], Outcome]
    ) -> Outcome:
        """One message's writes in a savepoint: a bug it triggers cannot take the batch
        of other edges' messages down with it (they commit and are acked as usual)."""
        try:
            with tx.savepoint():
                return handle()
        except Exception as exc:
            if unwritable(exc):
                raise  # the store refused, not this message: the whole batch is held
            ingestor.forget_cache()
            log.exception("internal error on one message; it is recorded and dropped")
            self.counters["internal_error"] += 1
            return Outcome(Verdict.REJECTED, "internal", f"{type(exc).__name__}: {exc}")

    def _isolated_step(
        self, tx: IngestTransaction, ingestor: Ingestor, step: Callable[[], object]
    ) -> None:
        """A publisher's bookkeeping in the batch, in a savepoint like a message: a bug in
        it is logged and counted, and never holds the batch (only a store that refuses
        writes does: that holds everything, as it must)."""
        try:
            with tx.savepoint():
                step()
        except Exception as exc:
            if unwritable(exc):
                raise
            ingestor.forget_cache()
            log.exception("internal error in the publisher's bookkeeping; it is dropped")
            self.counters["internal_error"] += 1

    def _drive_rollouts(self, driver: RolloutDriver) -> None:
        """Staged rollouts (rollouts.py): a tick about once a second; the desired documents
        it writes are published right after, by this same thread (no paho lock held)."""
        now = time.time()
        if now < self._rollouts_due:
            return
        self._rollouts_due = now + ROLLOUT_TICK_S
        try:
            self.counters["rollout.steps"] += driver.tick(now)
        except Exception:  # the worker outlives any one failed tick (it is rolled back)
            log.exception("rollout tick failed; it is tried again in a second")

    def _prune(self, store: Store) -> None:
        """Retention (retention.py): one bounded step when due, between ingest batches."""
        now = time.time()
        if not self.pruner.due(now):
            return
        try:
            pruned = self.pruner.run(store, now)
        except StoreError:
            log.exception("pruning failed; it is tried again at the next interval")
            return
        self.counters.update({f"pruned.{what}": n for what, n in pruned.items() if n})

    def _watch(self, monitor: Monitor) -> None:
        """The monitor (monitor.py): one tick when due; what it raised or cleared is
        published on the fleet's alerts topic (QoS 1, not retained: the store keeps them)."""
        now = time.time()
        if now < self._monitor_due:
            return
        self._monitor_due = now + self.settings.monitor_interval_s
        try:
            monitor.tick(now, publish=self._publish_alert)
        except Exception:  # the worker outlives any one failed tick (it is rolled back)
            log.exception("monitor tick failed; it is tried again at the next interval")

    def _publish_alert(self, alert: Alert) -> bool:
        """Hand one alert to MQTT; False (the monitor offers an operator's clearing again
        next tick) when the broker cannot take it now."""
        self.counters[f"alerts.{alert.state.value}"] += 1
        try:
            self.mqtt.publish(topics.alerts(self.settings.fleet), codec.encode(alert), qos=1)
        except TransportError:
            log.exception("could not publish alert %s (it is in the store)", alert.alert_id)
            return False
        return True

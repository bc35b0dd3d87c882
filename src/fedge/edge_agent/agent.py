"""``fedge agent run``: the edge agent, wiring MQTT, the local store, deployments and inference.

Threads: paho's network thread (callbacks only enqueue or do short work), a deploy thread
(downloads never block MQTT), and a publisher thread that seals pending records into
numbered batches and drains the outbox, deleting a batch only on the broker's PUBACK
(publisher.py). What a session states about the agent is assembled in statements.py;
whether the station trains is decided in training.py. What the station serves now (the
model, the config in force, the session number) is one :class:`ServingState`
(serving.py), handed to the parts that read or change it.
"""

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from fedge import __version__
from fedge.edge_agent.config import pace as telemetry_pace
from fedge.edge_agent.config.freshness import DesiredFreshness
from fedge.edge_agent.config.labels import apply_labels
from fedge.edge_agent.config.privacy_budget import write_floor
from fedge.edge_agent.config.station import Configs
from fedge.edge_agent.deploy.models import Deployments
from fedge.edge_agent.errors import InferenceError
from fedge.edge_agent.identity.renewal import renewer_for
from fedge.edge_agent.identity.trust import KeyTrust
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.inference.batch import Scored
from fedge.edge_agent.inference.evaluations import Evaluations
from fedge.edge_agent.inference.scorer import ImageFile as ImageFile
from fedge.edge_agent.inference.scorer import Scorer
from fedge.edge_agent.metrics.collector import AgentMetrics, AgentReadings
from fedge.edge_agent.metrics.readiness import agent_readiness, uplink_problem, write_problem
from fedge.edge_agent.serving import ServingState
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.edge_agent.training.spec import supernode_spec
from fedge.edge_agent.training.supervisor import SupernodeSupervisor
from fedge.edge_agent.uplink.outbox import OutboxSender, stream_topic
from fedge.edge_agent.uplink.poller import DesiredPoller
from fedge.edge_agent.uplink.publisher import Publisher
from fedge.edge_agent.uplink.statements import done_versions, in_force, liveness
from fedge.edge_agent.uplink.telemetry import add_metric, emit_metrics
from fedge.party.station_store import StationData
from fedge.protocols import codec, topics
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.protocols.manifest import Preprocess
from fedge.transport.grpc.client import DesiredClient, ReportUploader
from fedge.transport.metrics import Readiness
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import Message, PublishResult, Session, SessionFactory, Will

log = logging.getLogger(__name__)


class EdgeAgent:
    def __init__(self, settings: AgentSettings, *, sessions: SessionFactory = MqttSession) -> None:
        """``sessions`` makes the MQTT session: a real broker's by default, or an
        in-memory one (``MemoryBroker.session``) for fast behaviour tests."""
        self.settings = settings
        self.store = LocalStore(settings.data_dir / "agent.db")
        # The telemetry pace the manager last asked for (issue 33), kept across restarts.
        self.pace = telemetry_pace.current(self.store)
        self.counters: Counter[str] = Counter()
        # How fresh the signed desired state is (expiry and refresh: a freeze attack).
        self.freshness = DesiredFreshness(self.store, settings.desired_stale_after_days * 86400.0)
        # The manager's key: pinned in agent.toml, moved on by signed rotations (trust.py).
        self.trust = KeyTrust(
            settings.edge,
            settings.fleet,
            settings.public_key(),
            self.store,
            self.counters,
            report=self._report_status,
            handlers=self._handlers,
            freshness=self.freshness,
            root=settings.root_key(),
        )
        self.keys = self.trust.keys
        # The station's training set: what it scores, kept on the device with its labels.
        self.station = StationData(settings.data_dir, settings.retention())
        # The station's own privacy floor, from agent.toml into the ledger its ClientApp
        # checks (issue 24): before any SuperNode can start a round.
        write_floor(settings.data_dir, settings.privacy_floor)
        self.supervisor: SupernodeSupervisor | None = None
        self.session = self.store.get("session")
        # Where the station serves its images to the manager (edge_agent/viewing/server.py;
        # set by whoever starts that server, before start()), stated in every birth.
        self.images_at: str | None = None
        # What the station serves now; its parts read and change it there (serving.py).
        self.serving_state = ServingState(
            threading.Lock(),
            config=self._load_config(),
            session=int(self.session) if self.session is not None else -1,
        )
        self.deployments = Deployments(
            settings,
            self.store,
            self.keys,
            self.counters,
            serving=self.serving_state,
            report=self._report_status,
        )
        self.serving_state.install(self.deployments.restore_active())
        # Prometheus metrics in this agent's own registry, on its local API (issue 27).
        self.metrics = AgentMetrics(settings.edge)
        self.scorer = Scorer(
            settings,
            self.store,
            self.station,
            self.counters,
            serving=self.serving_state,
            observe=self._observe_scored,
        )
        self._commits = self.scorer.commits  # one commit group per agent
        # The gate's evaluations of candidate models on the station's held-out images.
        self.evaluations = Evaluations(
            settings, self.store, self.station, self.keys, self.counters, report=self._report_status
        )
        self.configs = Configs(
            settings,
            self.store,
            self.keys,
            self.counters,
            serving=self.serving_state,
            deployments=self.deployments,
            applied=self._apply_training,
            report=self._report_status,
            freshness=self.freshness,
        )
        # Built here, connected in start(): offline tools (label, score) never touch the broker.
        self.mqtt: Session = sessions(
            settings.mqtt(),
            on_message=self._on_message,
            on_connect=self._on_connect,
            on_published=self._on_published,
            will_factory=self._next_will,
            lazy_will=True,
        )
        # Renews the station's certificate before it expires (None: --insecure).
        self.renewer = renewer_for(settings, self.mqtt.reload_certificate)
        # ``publish`` is resolved at each send (tests replace self.mqtt with a paho-like twin).
        self.outbox = OutboxSender(
            self.store,
            self.counters,
            publish=lambda topic, payload: self.mqtt.publish(topic, payload, qos=1),
            topic=partial(stream_topic, settings.fleet, settings.edge),
            uploader_factory=partial(
                ReportUploader,
                settings.grpc_target,
                settings.edge,
                settings.password,
                tls=settings.tls(),
            ),
        )
        # Configs, deployments and labels (and status reports) over gRPC where MQTT is
        # blocked (issue 9); ticked by the publisher thread.
        self.desired_poller = DesiredPoller(
            report_via_grpc=settings.report_via == "grpc",
            fallback_after_s=settings.grpc_fallback_after_s,
            poll_interval_s=settings.grpc_poll_interval_s,
            connect=partial(
                DesiredClient,
                settings.grpc_target,
                settings.edge,
                settings.password,
                tls=settings.tls(),
            ),
            mqtt_connected=self.mqtt.connected.is_set,
            known_versions=self._known_versions,
            handlers={kind.value: partial(self._route, kind) for kind in topics.Down},
            statements=self._statements,
            counters=self.counters,
            heartbeat_s=settings.heartbeat_s,
        )
        self._publisher = Publisher(
            settings,
            self.store,
            self.counters,
            outbox=self.outbox,
            poller=self.desired_poller,
            serving=self.serving_state,
            connected=self.mqtt.connected.is_set,
            emit_metrics=self._emit_metrics,
            heartbeat=self._heartbeat,
            telemetry_pace=lambda: self.pace.factor,
        )
        self.metrics.read(
            AgentReadings(
                counters=lambda: self.counters,
                backlog=self.store.backlog,
                oldest_unsent_at=self.store.oldest_unsent_at,
                serving=lambda: self.serving,
                config_version=lambda: self.applied_version,
                broker_connected=self.mqtt.connected.is_set,
                desired_via_grpc=lambda: self.desired_poller.active,
                data_dir=settings.data_dir,
                cert_file=None if settings.insecure else settings.cert_file,
            )
        )

    # -- persistent state

    def _load_config(self) -> EdgeConfig | None:
        raw = self.store.get("applied_config")
        return None if raw is None else codec.decode(raw.encode(), EdgeConfig)

    # What serves now, read from the serving state (install and commit change it there).

    @property
    def model(self) -> runtime.LoadedModel | None:
        return self.serving_state.model

    @property
    def config(self) -> EdgeConfig | None:
        return self.serving_state.config

    @property
    def serving(self) -> str:
        return self.serving_state.ref

    @property
    def applied_version(self) -> int:
        return self.serving_state.applied_version

    # -- lifecycle

    def start(self) -> None:
        self.station.sweep_orphans()
        self.supervisor = SupernodeSupervisor(self.settings.data_dir / "supernode")
        self.supervisor.start()
        self._apply_training()
        if self.renewer is not None:
            self.renewer.start()
        self.mqtt.start()  # takes the first will (a new session number) now
        self._publisher.start()

    def stop(self) -> None:
        self._publisher.stop()
        if self.renewer is not None:
            self.renewer.stop()
        self._publisher.join(timeout=5)
        goodbye = liveness(
            self.settings.edge,
            max(self.serving_state.session, 0),
            EdgeState.OFFLINE,
            self.serving,
            self.applied_version,
        )
        self.desired_poller.farewell(codec.encode(goodbye))
        self.desired_poller.close()
        self.mqtt.stop(final=(self._topic(topics.Up.STATE), codec.encode(goodbye), True))
        if self.supervisor is not None:
            self.supervisor.stop()
        self.scorer.close()
        self.store.close()
        self.station.close()

    def _apply_training(self) -> None:
        """Run the station's SuperNode while its config enables training; stop it otherwise."""
        if self.supervisor is not None:
            app_keys = tuple(self.keys.values())
            self.supervisor.apply(
                supernode_spec(self.settings, self.config, self.counters, app_keys=app_keys)
            )

    def _topic(self, kind: topics.Up) -> str:
        return topics.up(self.settings.fleet, self.settings.edge, kind)

    def _next_will(self) -> Will:
        session = self.serving_state.session = self.store.next_session()
        will = Liveness(self.settings.edge, session, EdgeState.LOST, __version__, at=0.0)
        return Will(self._topic(topics.Up.STATE), codec.encode(will), qos=1, retain=True)

    def _on_connect(self, session_present: bool) -> None:
        # Sparkplug order: subscribe first, then the birth, then re-state what is in force.
        self.mqtt.subscribe(topics.edge_subscription(self.settings.fleet, self.settings.edge))
        for kind, payload in self._statements():
            self.mqtt.publish(self._topic(kind), payload, retain=True)
        self.counters["connects"] += 1

    def _heartbeat(self) -> None:
        """The birth again, QoS 0 and not retained (issue 27): any sign of life keeps the
        edge online at the manager, whose sweep marks a silent one lost within seconds
        (edge_manager/fleet/liveness.py). Over gRPC the poller beats instead."""
        if not self.mqtt.connected.is_set():
            return
        edge, session = self.settings.edge, self.serving_state.session
        birth = liveness(
            edge, session, EdgeState.ONLINE, self.serving, self.applied_version, self.images_at
        )
        self.mqtt.publish(self._topic(topics.Up.STATE), codec.encode(birth), qos=0)

    def alive(self) -> bool:
        """Whether the agent's work goes on: its publisher thread runs (systemd watchdog)."""
        return self._publisher.alive

    def readiness(self) -> Readiness:
        """``/readyz``: reports can leave, the data directory takes writes, a model serves."""
        return agent_readiness(
            uplink=uplink_problem(
                broker_connected=self.mqtt.connected.is_set(),
                via_grpc=self.desired_poller.active,
            ),
            store_writable=write_problem(self.settings.data_dir),
            serving=self.serving,
        )

    def _observe_scored(
        self,
        model: runtime.LoadedModel,
        rows: np.ndarray,
        latencies_ms: Sequence[float],
        errors: int,
        anomaly_unscored: Sequence[bool],
    ) -> None:
        self.metrics.observe_latencies(latencies_ms)
        self.deployments.probation.observe(model, rows, latencies_ms, errors, anomaly_unscored)

    def _statements(self) -> list[tuple[topics.Up, bytes]]:
        """What a new session states, in order: the birth, then what is in force."""
        edge, session = self.settings.edge, self.serving_state.session
        birth = liveness(
            edge, session, EdgeState.ONLINE, self.serving, self.applied_version, self.images_at
        )
        return in_force(
            birth,
            configs=self.configs,
            deployments=self.deployments,
            evaluations=self.evaluations,
            trust=self.trust,
        )

    def _known_versions(self) -> dict[str, int]:
        """The version of each desired document this agent is done with (for gRPC polls)."""
        return done_versions(
            self.applied_version,
            self.store,
            deployments=self.deployments,
            evaluations=self.evaluations,
            trust=self.trust,
        )

    # -- incoming

    def _on_message(self, message: Message) -> None:
        try:
            parsed = topics.parse(message.topic)
            if (
                parsed.edge != self.settings.edge
                or parsed.fleet != self.settings.fleet
                or parsed.direction is not topics.Direction.DOWN
            ):
                raise ProtocolError(f"unexpected topic {message.topic!r}")
            kind = topics.Down(parsed.kind)
        except (ProtocolError, ValueError) as exc:
            self.counters["rejected.topic"] += 1
            log.warning("ignored message: %s", exc)
            return
        self._route(kind, message.payload)

    def _handlers(self) -> dict[str, Callable[[bytes], None]]:
        return {
            topics.Down.TRUST.value: self._handle_trust,
            topics.Down.CONFIG.value: self.handle_config,
            topics.Down.DEPLOY.value: self.handle_deploy,
            topics.Down.LABELS.value: self.handle_labels,
            topics.Down.EVALUATE.value: self.handle_evaluate,
            topics.Down.PACE.value: self.handle_pace,
        }

    def _handle_trust(self, payload: bytes) -> None:
        """A rotation moves the key the SuperNode accepts apps from too (a changed spec
        restarts it): apps the old key signed are not run any more."""
        self.trust.handle(payload)
        self._apply_training()

    def _route(self, kind: topics.Down, payload: bytes) -> None:
        """One desired document (MQTT or gRPC) to its handler. One signed by a key not
        trusted yet is also kept, for after a rotation that introduces that key."""
        if kind is not topics.Down.TRUST:
            self.trust.hold_if_unknown(kind.value, payload)
        self._handlers()[kind.value](payload)

    def handle_labels(self, envelope: bytes) -> None:
        """Labels an operator gave at the manager: into the station's training set, once."""
        apply_labels(
            envelope,
            settings=self.settings,
            keys=self.keys,
            store=self.store,
            station=self.station,
            counters=self.counters,
        )

    def handle_pace(self, envelope: bytes) -> None:
        """The manager, short of space, asks for telemetry less often (or normal again)."""
        settings = self.settings
        applied = telemetry_pace.apply_pace(
            envelope,
            fleet=settings.fleet,
            edge=settings.edge,
            keys=self.keys,
            store=self.store,
            counters=self.counters,
        )
        if applied is not None:
            self.pace = applied

    def handle_config(self, envelope: bytes) -> None:
        self.configs.handle(envelope)

    def handle_deploy(self, envelope: bytes) -> None:
        self.deployments.handle(envelope)

    def handle_evaluate(self, envelope: bytes) -> None:
        self.evaluations.handle(envelope)

    def _report_status(self, kind: topics.Up, payload: bytes, retained: bool) -> None:
        """A status document on the edge's up/ topic; over gRPC too while MQTT is down."""
        self.mqtt.publish(self._topic(kind), payload, retain=retained)
        self.desired_poller.offer_status(kind, payload, retained=retained)

    # -- inference (see :mod:`fedge.edge_agent.inference.scorer`)

    def preprocess_for(self, model: runtime.LoadedModel) -> Preprocess:
        return self.scorer.preprocess_for(model)

    def score_image(
        self, data: bytes, *, suffix: str, source: str = "", keep: bool = True
    ) -> Scored:
        return self.scorer.score_image(data, suffix=suffix, source=source, keep=keep)

    def score_images(self, files: Sequence[ImageFile]) -> list[Scored | InferenceError]:
        return self.scorer.score_images(files)

    def score(
        self, image: np.ndarray, source: str = "", *, model: runtime.LoadedModel | None = None
    ) -> Scored:
        return self.scorer.score(image, source, model=model)

    def score_many(
        self,
        images: Sequence[np.ndarray],
        sources: Sequence[str] | None = None,
        *,
        model: runtime.LoadedModel | None = None,
        arrivals: Sequence[str] | None = None,
    ) -> list[Scored]:
        return self.scorer.score_many(images, sources, model=model, arrivals=arrivals)

    def add_metric(self, name: str, value: float) -> None:
        add_metric(self.store, name, value)

    # -- outgoing records (the publisher thread: publisher.py)

    def _drain_outbox(self) -> None:
        self.outbox.drain()

    def _on_published(self, result: PublishResult) -> None:
        self.outbox.on_published(result)

    def _emit_metrics(self) -> None:
        self.trust.check_freshness()  # periodic: a desired state gone stale is reported
        training = self.supervisor.status() if self.supervisor is not None else None
        model = self.model
        provider = None if model is None else model.provider
        emit_metrics(self.store, self.settings, self.counters, self.station, training, provider)

    def status(self) -> dict[str, object]:
        return {
            "edge": self.settings.edge,
            "session": self.serving_state.session,
            "connected": self.mqtt.connected.is_set(),
            "desired_via_grpc": self.desired_poller.active,
            "serving": self.serving,
            # Which ONNX Runtime execution provider serves (agent.toml execution_providers).
            "execution_provider": None if self.model is None else self.model.provider,
            "config_version": self.applied_version,
            "threshold": None if self.config is None else self.config.default_threshold,
            "thresholds": self.serving_state.thresholds().describe(),
            "probation": self.deployments.probation.status(),
            "backlog": self.store.backlog(),
            "telemetry_pace": {"factor": self.pace.factor, "reason": self.pace.reason},
            "counters": dict(self.counters),
            "training": None if self.supervisor is None else self.supervisor.status(),
            "station": self.station.counts(),
            "desired_freshness": self.freshness.staleness().describe(),
        }

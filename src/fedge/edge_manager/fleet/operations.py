"""Fleet operations an operator runs: enrol edges, push thresholds, deploy models, label.

Every change is a new full desired document written to the store with the next version;
the serve loop publishes it (signed, retained). Writing to the store first means a push
made while the broker is down is published when it comes back, and nothing is lost if
``serve`` restarts.

An edge in an unfinished staged rollout belongs to the rollout: a deploy or threshold
change on it is refused naming the rollout unless forced (rollout_guard.py); the
rollout's own writes pass its id. Operators' labels live in fleet_labels.py.
"""

import hashlib
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Unpack

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.desired.decide import ConfigChange, next_config, next_deployment
from fedge.edge_manager.errors import ManagerError, UnknownEdgeError
from fedge.edge_manager.fleet import deployment_store, edge_store
from fedge.edge_manager.fleet import views as fleet_views
from fedge.edge_manager.fleet.class_names import suggestion, unknown_class
from fedge.edge_manager.fleet.edge_store import EdgeSummary
from fedge.edge_manager.home.layout import ManagerHome, is_wildcard
from fedge.edge_manager.labels import current as labels
from fedge.edge_manager.labels import operations as fleet_labels
from fedge.edge_manager.registry.pairs import anomaly_problem
from fedge.edge_manager.registry.recommendations import recommended_anomaly_threshold
from fedge.edge_manager.registry.versions import PublishedModel, Registry, parse_ref
from fedge.edge_manager.rollout.guard import refuse_if_in_rollout
from fedge.edge_manager.security import key_rotation
from fedge.edge_manager.store import Store
from fedge.protocols import codec, validate
from fedge.protocols.config import EdgeConfig, PrivacyBudget, TrainingPolicy
from fedge.protocols.deployment import DeploymentDesired
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import ModelManifest
from fedge.protocols.signing import SigningKey, trusted, unverified_payload, verify_envelope
from fedge.protocols.thumbnails import ThumbnailPolicy

CONFIG = desired_store.CONFIG
DEPLOY = desired_store.DEPLOY
LABELS = fleet_labels.LABELS


@dataclass(frozen=True)
class Pushed:
    edge: str
    version: int
    # The model version the config's thresholds are set for (None: any model).
    model: str | None = None


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Fleet:
    def __init__(
        self, store: Store, fleet: str, key: SigningKey, registry: Registry, grpc_target: str
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.key = key
        self.registry = registry
        self.grpc_target = grpc_target

    def use_key(self, key: SigningKey) -> None:
        """Sign with ``key`` from now on (after ``fedge manager rotate-key``)."""
        self.key = self.registry.key = key

    @classmethod
    def open(cls, home: ManagerHome, store: Store | None = None) -> "Fleet":
        """The fleet of a manager home: its store (a new connection unless given), signing
        key, registry and advertised gRPC target. The caller closes ``fleet.store``."""
        settings = home.settings()
        key = home.signing_key()
        store = Store(home.db_path) if store is None else store
        registry = Registry(store, home.artifacts, key)
        return cls(store, settings.fleet, key, registry, settings.agent_grpc_target)

    # -- edges

    def enroll(self, edge: str, token: str) -> None:
        try:
            validate.identifier(edge, "edge")
        except ProtocolError as exc:
            raise ManagerError(str(exc)) from None
        edge_store.enroll(self.store, edge, token_digest(token), time.time())
        # After a key rotation a new edge is told the chain too, and says it follows it.
        key_rotation.give_chain(self.store, self.fleet, edge, time.time(), self.key)

    def authenticate(self, edge: str, token: str) -> bool:
        stored = edge_store.token_sha256(self.store, edge)
        return stored is not None and stored == token_digest(token)

    def edges(self, selector: list[str] | None = None) -> list[str]:
        known = edge_store.names(self.store)
        if selector is None:
            return known
        missing = sorted(set(selector) - set(known))
        if missing:
            raise UnknownEdgeError(
                f"unknown edge(s) {', '.join(missing)}; enrol with `fedge edge enroll`"
            )
        return selector

    # -- desired configuration

    def desired_config(self, edge: str) -> EdgeConfig | None:
        return desired_store.latest_config(self.store, edge)

    def set_threshold(
        self,
        edges: list[str],
        threshold: float,
        class_name: str | None = None,
        model: str | None = None,
        *,
        force: bool = False,
    ) -> list[Pushed]:
        """A new config version on each edge, its thresholds tied to ``model`` (a version
        deployed to the edge), by default to the model of the edge's newest deployment
        (none deployed yet: the tie stays as it was). Refused, for all, on a bad edge,
        class or model, or an edge in an unfinished rollout (unless ``force``)."""
        self.edges(edges)
        refuse_if_in_rollout(self.store.conn, edges, "set a threshold", force=force)
        ties = {edge: self._threshold_model(edge, model) for edge in edges}
        if class_name is not None:
            for edge in edges:
                self._check_class(edge, class_name, ties[edge])
        return self._push_config(
            edges, "threshold", threshold=threshold, class_name=class_name, models=ties
        )

    def set_anomaly_threshold(
        self, edges: list[str], threshold: float | None, *, force: bool = False
    ) -> list[Pushed]:
        """The score over which each edge's anomaly model calls a part novel (issue 28;
        None: no longer set), a new signed config version each, tied to the anomaly model
        deployed beside the edge's classifier. Refused, for all, on a bad edge or value,
        or an edge in an unfinished rollout (unless ``force``)."""
        if threshold is None:
            self.edges(edges)
            refuse_if_in_rollout(self.store.conn, edges, "set an anomaly threshold", force=force)
            return self._push_config(edges, "anomaly threshold", clear_anomaly=True)
        return self.set_anomaly_thresholds(dict.fromkeys(edges, threshold), force=force)

    def set_anomaly_thresholds(
        self, values: Mapping[str, float], *, force: bool = False
    ) -> list[Pushed]:
        """Each edge its own anomaly threshold (``--anomaly recommended``: what each
        reported), tied to the anomaly model deployed beside its classifier (a refit
        moves every score: a threshold for one model means nothing for the next); a new
        signed config version each, refused for all, before any is pushed, on an unknown
        edge or one in an unfinished rollout (unless ``force``)."""
        edges = list(values)
        self.edges(edges)
        refuse_if_in_rollout(self.store.conn, edges, "set an anomaly threshold", force=force)
        pushed: list[Pushed] = []
        for edge, threshold in values.items():
            anomaly = self._deployed_anomaly(edge)
            pushed += self._push_config(
                [edge],
                "anomaly threshold",
                anomaly_threshold=threshold,
                anomaly_threshold_model=None if anomaly is None else anomaly.ref,
            )
        return pushed

    def _deployed_anomaly(self, edge: str) -> ModelManifest | None:
        """The anomaly model of ``edge``'s newest deployment (None: none beside it)."""
        document = desired_store.latest_document(self.store, edge, DEPLOY)
        envelope = None
        if document is not None:
            envelope = codec.decode(document.encode(), DeploymentDesired).anomaly_envelope
        return None if envelope is None else unverified_payload(envelope.encode(), ModelManifest)

    def recommended_anomaly_threshold(self, edge: str) -> tuple[float, str]:
        """The anomaly threshold ``edge`` reported for the anomaly model deployed beside
        its classifier, and that model's ref (issue 28); ManagerError saying why none."""
        self.edges([edge])
        anomaly = self._deployed_anomaly(edge)
        if anomaly is None:
            raise ManagerError(
                f"{edge} has no anomaly model deployed beside its classifier (fedge deploy "
                "MODEL --anomaly NAME:VERSION); nothing was changed"
            )
        value = recommended_anomaly_threshold(
            self.registry.artifacts, anomaly.name, anomaly.version, edge
        )
        return value, anomaly.ref

    def _threshold_model(self, edge: str, model: str | None) -> str | None:
        """The model version ``edge``'s thresholds are for: ``model`` if it was deployed
        to the edge, else the model of its newest deployment."""
        if model is None:
            deployed = self.deployed_model(edge)
            return None if deployed is None else f"{deployed[0]}:{deployed[1]}"
        name, version = parse_ref(model)
        self.registry.get(name, version)  # unknown: UnknownModelError, nothing changed
        refs = [f"{n}:{v}" for n, v in desired_store.deployed_models(self.store, edge)]
        if f"{name}:{version}" not in refs:
            raise ManagerError(
                f"{name}:{version} was never deployed to {edge} (deployed: "
                f"{', '.join(refs) or 'none'}); deploy it first, or leave out --model to "
                "tie the threshold to the model the edge runs; nothing was changed"
            )
        return f"{name}:{version}"

    def clear_threshold(
        self, edges: list[str], class_name: str, *, force: bool = False
    ) -> list[Pushed]:
        """Remove ``class_name``'s threshold on ``edges`` (the default applies to it again):
        a new signed config version each. Refused, for all, if one edge has none or is in
        an unfinished rollout (unless ``force``)."""
        refuse_if_in_rollout(self.store.conn, self.edges(edges), "unset a threshold", force=force)
        for edge in self.edges(edges):
            desired = self.desired_config(edge)
            per_class = {} if desired is None else desired.class_thresholds
            if class_name not in per_class:
                has = ", ".join(sorted(per_class)) or "none"
                raise ManagerError(
                    f"{edge} has no threshold for class {class_name!r}"
                    f"{suggestion(class_name, per_class)}; its per-class thresholds: {has}; "
                    "nothing was changed"
                )
        return self._push_config(edges, "clear", clear_class=class_name)

    def _check_class(self, edge: str, class_name: str, model: str | None = None) -> None:
        """Refuse a per-class threshold for a class the edge's model (or ``model``, the
        one the threshold is for) does not have."""
        deployed = self.deployed_model(edge) if model is None else parse_ref(model)
        if deployed is not None:
            known = set(self.registry.get(*deployed).manifest.classes)
            where = f"a class of {deployed[0]}:{deployed[1]}, the model deployed to {edge}"
        else:
            known = {c for row in self.registry.list() for c in row.classes}
            where = f"a class of any published model (nothing is deployed to {edge} yet)"
        refusal = unknown_class(class_name, known, where)
        if refusal is not None:
            raise ManagerError(f"{refusal}; nothing was changed")

    def deployed_model(self, edge: str) -> tuple[str, int] | None:
        """(name, version) of the model in ``edge``'s latest desired deployment, if any."""
        return desired_store.deployed_model(self.store, edge)

    def deployed_anomaly(self, edge: str) -> str | None:
        """``name:version`` of the anomaly model in ``edge``'s latest desired deployment
        (None: none beside its classifier; issue 28)."""
        anomaly = self._deployed_anomaly(edge)
        return None if anomaly is None else anomaly.ref

    def set_training(self, edges: list[str], policy: TrainingPolicy) -> list[Pushed]:
        """Enable or disable local training on ``edges`` (a new signed config version each)."""
        return self._push_config(edges, "training", training=policy)

    def set_privacy(
        self, edges: list[str], epsilon: float | None, delta: float = 1e-3
    ) -> list[Pushed]:
        """The stations' lifetime privacy budget (``epsilon`` None: no lifetime bound), a
        new signed config version each; their agents keep it in the station's ledger."""
        try:
            budget = None if epsilon is None else PrivacyBudget(epsilon, delta)
        except ProtocolError as exc:
            raise ManagerError(f"{exc}; nothing was changed") from None
        return self._push_config(edges, "privacy", privacy=budget, clear_privacy=budget is None)

    def set_thumbnails(self, edges: list[str], policy: ThumbnailPolicy | None) -> list[Pushed]:
        """Make ``edges`` share thumbnails of what they score (``policy``), or stop
        (None: their images stay on the station); a new signed config version each."""
        if policy is None:
            return self._push_config(edges, "thumbnails", clear_thumbnails=True)
        return self._push_config(edges, "thumbnails", thumbnails=policy)

    def set_viewing(self, edges: list[str], allowed: bool) -> list[Pushed]:
        """Let operators view ``edges``' images on demand, or stop (issue 30; an admin's
        decision, checked by the caller); a new signed config version each."""
        return self._push_config(edges, "viewing", viewing=allowed)

    def _push_config(
        self,
        edges: list[str],
        what: str,
        *,
        models: dict[str, str | None] | None = None,
        **change: Unpack[ConfigChange],
    ) -> list[Pushed]:
        self.edges(edges)
        pushed = []
        now = time.time()
        with self.store.transaction():
            for edge in edges:
                if models is not None:
                    change["model"] = models.get(edge)
                try:
                    config = next_config(
                        self.desired_config(edge), fleet=self.fleet, edge=edge, now=now, **change
                    )
                except ProtocolError as exc:
                    raise ManagerError(f"{what} for {edge}: {exc}") from None
                self._write_desired(edge, CONFIG, config.version, codec.encode(config), now)
                pushed.append(Pushed(edge, config.version, config.model))
        return pushed

    def _write_desired(
        self, edge: str, kind: str, version: int, document: bytes, now: float
    ) -> None:
        envelope = self.key.sign_payload(document)
        desired_store.write(
            self.store.conn, edge, kind, version, document.decode(), envelope.decode(), now
        )

    def write_desired(
        self, edge: str, kind: str, version: int, document: bytes, now: float
    ) -> None:
        """A desired document of a kind another module builds (the gate's "evaluate",
        gating.py): signed here and published by the serve loop like the others."""
        self._write_desired(edge, kind, version, document, now)

    # -- deployments

    def deploy(
        self,
        name: str,
        version: int,
        edges: list[str],
        *,
        force: bool = False,
        within_rollout: str | None = None,
        anomaly: tuple[str, int] | None = None,
    ) -> str:
        """A deployment of ``name:version`` to ``edges``; its id. Refused, with nothing
        written, for an unknown or damaged model, an unknown edge, or an edge in an
        unfinished staged rollout -- unless ``force``, or the call is that rollout's own
        (``within_rollout``: its id). ``anomaly``: an anomaly model (name, version) the
        edges serve beside it (issue 28), fetched, verified and swapped in with it."""
        if is_wildcard(self.grpc_target.rpartition(":")[0]):  # edges fetch the model there
            raise ManagerError(
                f"edges cannot fetch a model from {self.grpc_target}, a wildcard address; "
                "set the address agents reach this manager at with `fedge manager advertise HOST`"
            )
        model = self.registry.get(name, version)
        self.edges(edges)
        refuse_if_in_rollout(self.store.conn, edges, "deploy", within=within_rollout, force=force)
        model.verify()  # a damaged registry copy is refused here, before anything is written
        companion = None if anomaly is None else self.anomaly_companion(model.manifest, anomaly)
        deployment_id = f"d-{uuid.uuid4().hex[:12]}"
        now = time.time()
        with self._writing():
            deployment_store.record(self.store.conn, deployment_id, name, version, edges, now)
            for edge in edges:
                current = desired_store.latest_version(self.store, edge, DEPLOY)
                desired = next_deployment(
                    current,
                    fleet=self.fleet,
                    edge=edge,
                    deployment_id=deployment_id,
                    manifest_envelope=model.envelope.decode(),
                    grpc_target=self.grpc_target,
                    now=now,
                    anomaly_envelope=None if companion is None else companion.envelope.decode(),
                )
                self._write_desired(edge, DEPLOY, desired.version, codec.encode(desired), now)
        return deployment_id

    def anomaly_companion(
        self, classifier: ModelManifest, anomaly: tuple[str, int], *, images: bool = False
    ) -> PublishedModel:
        """The published anomaly model ``anomaly`` checked to serve beside ``classifier``
        (issue 28): in the registry, its artifact matching its manifest, the manifest
        signed by this manager's key, an anomaly model (and, with ``images``, one taking
        the classifier's images: a staged rollout checks it before anything moves; a
        direct deployment leaves it to the stations, which fail the pair). ManagerError
        names what is wrong; nothing is written."""
        companion = self.registry.get(*anomaly)
        companion.verify()
        ref = companion.manifest.ref
        try:
            signed = codec.decode(
                verify_envelope(companion.envelope, trusted(self.key.public)), ModelManifest
            )
        except ProtocolError as exc:
            raise ManagerError(
                f"anomaly model {ref}: its manifest is not signed by this manager's key "
                f"({exc}); publish it again (`fedge model publish`); nothing was changed"
            ) from None
        if signed != companion.manifest:
            raise ManagerError(
                f"anomaly model {ref}: its signed manifest differs from the registry's; "
                "publish it again; nothing was changed"
            )
        problem = anomaly_problem(classifier, companion.manifest, images=images)
        if problem is not None:
            raise ManagerError(f"{problem}; nothing was changed")
        return companion

    # -- staged rollouts (rollouts.py): a step's writes join the caller's transaction

    def _writing(self) -> AbstractContextManager[object]:
        """A transaction of its own, or the caller's when one is open: a rollout step
        records a move and writes the edge's deployment and config in one transaction."""
        return nullcontext() if self.store.conn.in_transaction else self.store.transaction()

    def push_config(
        self, config: EdgeConfig, now: float, *, within_rollout: str | None = None
    ) -> Pushed:
        """Write ``config`` (a full document, e.g. thresholds tied to a model) as the edge's
        next desired config; its version must be the next one (``desired.next_config``).
        Refused on an edge in an unfinished rollout other than ``within_rollout``."""
        self.edges([config.edge])
        refuse_if_in_rollout(self.store.conn, [config.edge], "push a config", within=within_rollout)
        current = self.desired_config(config.edge)
        expected = 1 if current is None else current.version + 1
        if config.version != expected:
            raise ManagerError(
                f"config v{config.version} for {config.edge} is stale: the next version is "
                f"v{expected}; build it from the current desired config"
            )
        with self._writing():
            self._write_desired(config.edge, CONFIG, config.version, codec.encode(config), now)
        return Pushed(config.edge, config.version)

    # -- views

    def show(self, edge: str) -> fleet_views.EdgeView:
        """One edge, desired beside reported (fleet_views.show); UnknownEdgeError if it is
        not enrolled."""
        return fleet_views.show(self, edge)

    def list(self) -> list[EdgeSummary]:
        """Every enrolled edge as it last reported, by name."""
        return edge_store.summaries(self.store)

    def label_agreement(self, edge: str) -> float | None:
        return labels.agreement(self.store.conn, edge)

    # -- operator labels (fleet_labels.py)

    def add_label(self, prediction_id: str, label: str, who: str) -> tuple[str, labels.Outcome]:
        """Label a prediction, or relabel it (fleet_labels.add_label)."""
        return fleet_labels.add_label(self, prediction_id, label, who)


@contextmanager
def opened(home: ManagerHome) -> Iterator[Fleet]:
    """:meth:`Fleet.open` on a store connection of its own, closed afterwards."""
    fleet = Fleet.open(home)
    try:
        yield fleet
    finally:
        fleet.store.close()

"""The station's models: restored at start-up, deployed by the manager, pruned after.

One :class:`Deployments` per agent. It owns the deploy thread and the deployment state
in the agent's store (``active_model``, ``model_history``, ``deploy_done_version``,
``last_deploy_status``); the agent owns the model it serves and the transports, which
this module reaches only through the callbacks it is given:

- ``install(model)``: make ``model`` the one the agent serves (called under ``lock``,
  together with the store writes that make the swap survive a restart);
- ``serving()``: the model the agent serves now (reported with every status);
- ``report(kind, payload, retained)``: publish a deploy status on the edge's ``up/``
  topic (MQTT, and gRPC while MQTT is down).

Restoring: see :mod:`fedge.edge_agent.restore`; the download, verification and smoke
test of a deployment: :mod:`fedge.edge_agent.deployer`.
"""

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from fedge.edge_agent import deployer, restore, runtime
from fedge.edge_agent.errors import DeployError
from fedge.edge_agent.local_store import LocalStore
from fedge.edge_agent.settings import AgentSettings
from fedge.protocols import codec, topics
from fedge.protocols.deployment import DeploymentDesired, DeployStage, DeployStatus
from fedge.protocols.errors import ProtocolError
from fedge.protocols.signing import TrustedKeys, open_signed

log = logging.getLogger(__name__)

Report = Callable[[topics.Up, bytes, bool], None]


class Deployments:
    def __init__(
        self,
        settings: AgentSettings,
        store: LocalStore,
        keys: TrustedKeys,
        counters: Counter[str],
        *,
        lock: threading.Lock,
        install: Callable[[runtime.LoadedModel], None],
        serving: Callable[[], str],
        report: Report,
    ) -> None:
        self.settings = settings
        self.store = store
        self.keys = keys
        self.counters = counters
        self._lock = lock
        self._install = install
        self._serving = serving
        self._report = report
        self._deploy_lock = threading.Lock()
        stored = store.get("last_deploy_status")
        # Re-stated (retained) by every new session, after the birth.
        self.last_status: bytes | None = None if stored is None else stored.encode()

    @property
    def done_version(self) -> int:
        """The newest deployment version this station is done with (applied or failed)."""
        return int(self.store.get("deploy_done_version") or 0)

    # -- start-up

    def restore_active(self) -> runtime.LoadedModel | None:
        """The model to serve after a start: the active one if it still verifies, else the
        newest previous model that does (see :mod:`fedge.edge_agent.restore`)."""
        raw = self.store.get("active_model")
        if raw is None:
            return None
        history = restore.decode_history(self.store.get("model_history"))
        active: restore.KeptModel | None = None
        unreadable: DeployError | None = None
        try:
            active = restore.decode_kept(raw)
        except DeployError as exc:
            unreadable = exc
        restored = restore.restore(
            restore.candidates(active, history), lambda kept: restore.verify(kept, self.keys)
        )
        for kept, failure in restored.failures:
            if kept is not active:
                log.error("kept model %s does not verify either: %s", kept.ref, failure)
        if unreadable is None and restored.kept is active:
            return restored.model
        error = unreadable or restored.failures[0][1]
        self._restore_failed(active, error, restored.kept)
        return restored.model

    def _restore_failed(
        self,
        active: restore.KeptModel | None,
        error: DeployError,
        fallback: restore.KeptModel | None,
    ) -> None:
        """The active model did not verify: tell the manager, and fetch the deployment again.

        Runs before the session exists: the status is stored as the last deploy status,
        which every connection publishes (retained) after the birth; the lowered
        ``deploy_done_version`` makes the retained desired deployment due again.
        """
        self.counters["restore_failed"] += 1
        serving = "" if fallback is None else fallback.ref
        log.error(
            "cannot restore the active model %s (%s); serving %s until the deployment is "
            "fetched again",
            "?" if active is None else active.ref,
            error,
            serving or "none",
        )
        previous_raw = self.store.get("last_deploy_status")
        try:
            previous = (
                None if previous_raw is None else codec.decode(previous_raw.encode(), DeployStatus)
            )
        except ProtocolError:
            previous = None
        if active is not None and active.deployment_version:
            deployment_version = active.deployment_version
        else:
            deployment_version = 0 if previous is None else previous.version
        floor = restore.redeploy_floor(self.done_version, deployment_version)
        self.store.put("deploy_done_version", str(floor))
        status = restore.restore_status(
            self.settings.edge, active, previous, error, serving, time.time()
        )
        if status is not None:
            payload = codec.encode(status)
            self.store.put("last_deploy_status", payload.decode())
            self.last_status = payload

    # -- deployments from the manager

    def handle(self, envelope: bytes) -> None:
        """A desired deployment (MQTT or gRPC): checked here, carried out on its own thread."""
        try:
            desired = open_signed(envelope, DeploymentDesired, self.keys)
            if desired.edge != self.settings.edge or desired.fleet != self.settings.fleet:
                raise ProtocolError(f"deployment is for {desired.fleet}/{desired.edge}")
        except ProtocolError as exc:
            self.counters[f"deploy.rejected.{exc.reason}"] += 1
            log.error("deployment rejected (%s): %s", exc.reason, exc)
            self._report_rejected(f"rejected {exc.reason}: {exc}")
            return
        if desired.version <= self.done_version:
            self.counters["deploy.stale"] += 1
            return
        # Downloads never block the caller (paho's network thread, or the publisher).
        threading.Thread(target=self.deploy, args=(desired,), name="deploy", daemon=True).start()

    def deploy(self, desired: DeploymentDesired) -> None:
        """Download, verify, smoke-test and swap in ``desired``'s model; report each stage."""
        with self._deploy_lock:
            if desired.version <= self.done_version:
                return
            manifest_ref = ("", 0)

            def stage(stage: DeployStage, reason: str) -> None:
                self._report_stage(desired, manifest_ref, stage, reason)

            try:
                manifest = deployer.open_manifest(desired.manifest_envelope.encode(), self.keys)
                manifest_ref = (manifest.name, manifest.version)
                model = deployer.prepare(desired, self.settings, self.keys, stage)
                kept = restore.kept_from(desired, model)
                with self._lock:
                    # The signed manifest and the deployment go with the pointer: a start
                    # re-verifies the model, and falls back to an earlier one if it fails.
                    self.store.put("active_model", restore.encode_kept(kept))
                    history = restore.decode_history(self.store.get("model_history"))
                    self.store.put(
                        "model_history", restore.encode_history(restore.remember(history, kept))
                    )
                    self._install(model)
                self.counters["deploy.active"] += 1
                log.info("now serving %s", model.ref)
                stage(DeployStage.ACTIVE, "")
            except DeployError as exc:
                self.counters[f"deploy.failed.{exc.reason}"] += 1
                log.error(
                    "deployment %s failed, still serving %r: %s",
                    desired.deployment_id,
                    self._serving(),
                    exc,
                )
                stage(DeployStage.FAILED, f"{exc.reason}: {exc.detail}")
            self.store.put("deploy_done_version", str(desired.version))
            self.prune()

    def prune(self) -> None:
        """Old models and failed downloads go; the kept ones stay (see restore.prune_models)."""
        kept = list(restore.decode_history(self.store.get("model_history")))
        active = self.store.get("active_model")
        try:
            if active is not None:  # kept too, if an older agent wrote no history for it
                kept.append(restore.decode_kept(active))
            removed = restore.prune_models(self.settings.data_dir / "models", kept)
        except (OSError, DeployError) as exc:
            log.warning("could not prune old models: %s", exc)
            return
        self.counters["models.pruned"] += len(removed)

    def _report_stage(
        self, desired: DeploymentDesired, ref: tuple[str, int], stage: DeployStage, reason: str
    ) -> None:
        name, version = ref
        status = DeployStatus(
            self.settings.edge,
            desired.deployment_id,
            desired.version,
            name or "unknown",
            version,
            stage,
            reason[:1000],
            self._serving(),
            time.time(),
        )
        payload = codec.encode(status)
        self.last_status = payload
        self.store.put("last_deploy_status", payload.decode())
        self._report(topics.Up.DEPLOY, payload, True)

    def _report_rejected(self, reason: str) -> None:
        """Tell the manager a deployment envelope was refused (forged, malformed, foreign).

        Nothing in such an envelope can be trusted, so the status names no deployment
        (``unknown``, version 0) and reports the model still serving. It is neither kept as
        the last deploy status nor retained: the real deployment state stays what a
        reconnecting manager or agent sees; this report is for the manager listening now.
        """
        status = DeployStatus(
            self.settings.edge,
            "unknown",
            0,
            "unknown",
            0,
            DeployStage.FAILED,
            reason[:1000],
            self._serving(),
            time.time(),
        )
        self._report(topics.Up.DEPLOY, codec.encode(status), False)

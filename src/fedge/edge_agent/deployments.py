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

After a deployment activates, the new model is on probation
(:mod:`fedge.edge_agent.probation`, verdicts by :mod:`fedge.edge_agent.health`). One that
fails it is rolled back here: the previous kept model that verifies serves again (the
same swap as a deployment's, under the same locks), the manager gets a ``rolled_back``
status with the reason, the failed model leaves the kept history and its deployment is
remembered as rolled back (``rolled_back_deployments``), so neither a restart nor a
re-fetch of the retained desired document activates it again.
"""

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from fedge.edge_agent import deployer, health, restore, runtime
from fedge.edge_agent.errors import DeployError
from fedge.edge_agent.local_store import LocalStore
from fedge.edge_agent.probation import Probation, Trial
from fedge.edge_agent.settings import AgentSettings
from fedge.protocols import codec, topics
from fedge.protocols.deployment import DeploymentDesired, DeployStage, DeployStatus
from fedge.protocols.errors import ProtocolError
from fedge.protocols.signing import TrustedKeys, open_signed

log = logging.getLogger(__name__)

Report = Callable[[topics.Up, bytes, bool], None]

# The deployments this agent rolled back (id -> reason), never activated again.
ROLLED_BACK = "rolled_back_deployments"


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
        self.probation = Probation(settings.probation_policy(), store, counters, self.rollback)
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
        if restored.kept is not None:
            self.probation.resume(restored.kept.ref)
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
                self._report_stage(
                    desired.deployment_id, desired.version, manifest_ref, stage, reason
                )

            try:
                manifest = deployer.open_manifest(desired.manifest_envelope.encode(), self.keys)
                manifest_ref = (manifest.name, manifest.version)
                earlier = restore.decode_rolled_back(self.store.get(ROLLED_BACK))
                if desired.deployment_id in earlier:
                    # Due again only because a restore lowered the done version: it
                    # failed its probation here once and is not activated again.
                    self.counters["deploy.rolled_back_before"] += 1
                    reason = earlier[desired.deployment_id]
                    stage(DeployStage.ROLLED_BACK, f"rolled back earlier, not again: {reason}")
                    self.store.put("deploy_done_version", str(desired.version))
                    return
                model = deployer.prepare(desired, self.settings, self.keys, stage)
                kept = restore.kept_from(desired, model)
                with self._lock:
                    previous = self._serving()
                    # The signed manifest and the deployment go with the pointer: a start
                    # re-verifies the model, and falls back to an earlier one if it fails.
                    self.store.put("active_model", restore.encode_kept(kept))
                    history = restore.decode_history(self.store.get("model_history"))
                    self.store.put(
                        "model_history", restore.encode_history(restore.remember(history, kept))
                    )
                    self._install(model)
                    if previous and previous != model.ref:
                        self.probation.begin(
                            model, desired.deployment_id, desired.version, previous
                        )
                    else:  # nothing to go back to, or the same model again: no trial
                        self.probation.end()
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

    # -- the local rollback

    def rollback(self, trial: Trial, verdict: health.Verdict) -> None:
        """``trial``'s model failed its probation: serve the previous verified model again.

        Runs on its own thread (started by the probation). Nothing happens if another
        deployment replaced the model meanwhile.
        """
        with self._deploy_lock:
            raw = self.store.get("active_model")
            try:
                active = None if raw is None else restore.decode_kept(raw)
            except DeployError:
                active = None
            if active is None or (active.ref, active.deployment_id) != (
                trial.model,
                trial.deployment_id,
            ):
                self.counters["rollback.superseded"] += 1
                return
            history = restore.decode_history(self.store.get("model_history"))
            restored = restore.restore(
                restore.without(history, active), lambda kept: restore.verify(kept, self.keys)
            )
            for kept, failure in restored.failures:
                log.error("kept model %s does not verify: %s", kept.ref, failure)
            name, _, version = trial.model.rpartition(":")
            ref = (name, int(version))
            if restored.model is None or restored.kept is None:
                self.counters["rollback.no_previous"] += 1
                self.probation.end()
                log.error(
                    "%s failed its probation (%s) but no previous model verifies; still serving it",
                    trial.model,
                    verdict.reason,
                )
                self._report_stage(
                    trial.deployment_id,
                    trial.deployment_version,
                    ref,
                    DeployStage.FAILED,
                    f"health_check_failed: {verdict.reason}; no previous model verifies, "
                    f"still serving {trial.model}",
                )
                return
            model, previous = restored.model, restored.kept
            earlier = restore.decode_rolled_back(self.store.get(ROLLED_BACK))
            with self._lock:
                self.store.put("active_model", restore.encode_kept(previous))
                self.store.put(
                    "model_history",
                    restore.encode_history(
                        restore.remember(restore.without(history, active), previous)
                    ),
                )
                self.store.put(
                    ROLLED_BACK,
                    restore.encode_rolled_back(
                        restore.add_rolled_back(earlier, trial.deployment_id, verdict.reason)
                    ),
                )
                # The done version stays the bad deployment's: its retained desired
                # document is stale to this agent from now on, restarts included.
                done = max(self.done_version, trial.deployment_version)
                self.store.put("deploy_done_version", str(done))
                self.probation.end()
                self._install(model)
            self.counters["rollback.done"] += 1
            log.warning("rolled back from %s to %s: %s", trial.model, previous.ref, verdict.reason)
            self._report_stage(
                trial.deployment_id,
                trial.deployment_version,
                ref,
                DeployStage.ROLLED_BACK,
                f"{verdict.reason}; serving {previous.ref} again",
            )
            self.prune()

    def _report_stage(
        self,
        deployment_id: str,
        deployment_version: int,
        ref: tuple[str, int],
        stage: DeployStage,
        reason: str,
    ) -> None:
        name, version = ref
        status = DeployStatus(
            self.settings.edge,
            deployment_id,
            deployment_version,
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

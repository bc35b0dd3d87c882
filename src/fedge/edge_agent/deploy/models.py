"""The station's models: restored at start-up, deployed by the manager, pruned after.

One :class:`Deployments` per agent. It owns the deploy thread and the deployment state
in the agent's store (``active_model``, ``model_history``, ``deploy_done_version``,
``last_deploy_status``). What the station serves is the agent's
:class:`~fedge.edge_agent.serving.ServingState`, given to it: a swap installs the model
there (under its lock, after the store transaction that makes the swap survive a
restart), every status names the model it serves, and the config in force is
remembered per model (:mod:`fedge.edge_agent.deploy.served`). The transports are the
agent's: ``report(kind, payload, retained)`` publishes a deploy status on the edge's
``up/`` topic (MQTT, and gRPC while MQTT is down).

Restoring: see :mod:`fedge.edge_agent.deploy.restore`; the download, verification and smoke
test of a deployment: :mod:`fedge.edge_agent.deploy.deployer`.

After a deployment activates, the new model is on probation
(:mod:`fedge.edge_agent.deploy.probation`, verdicts by
:mod:`fedge.edge_agent.deploy.probation_verdict`). One that
fails it is rolled back (:mod:`fedge.edge_agent.deploy.rollback`): the model it replaced
serves again (the same swap as a deployment's, under the same locks), the manager gets a
``rolled_back`` status with the reason, the failed model leaves the kept history and its
deployment is remembered as rolled back (``rolled_back_deployments``), so neither a
restart nor a re-fetch of the retained desired document activates it again. One that
passes is *proven* here and reported ``passed``; a proven model deployed again (the
manager going back to it) is not put on probation again.
"""

import logging
import threading
import time
from collections import Counter
from dataclasses import replace

from fedge.edge_agent.deploy import deployer, restore, served
from fedge.edge_agent.deploy.probation import KEY as PROBATION
from fedge.edge_agent.deploy.probation import Trial, encode_trial, pair_ref
from fedge.edge_agent.deploy.rollback import ROLLED_BACK, LocalRollback
from fedge.edge_agent.deploy.status import DeployReports, Report
from fedge.edge_agent.errors import DeployError
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.serving import ServingState
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.deployment import DeploymentDesired, DeployStage, DeployStatus
from fedge.protocols.errors import ProtocolError
from fedge.protocols.signing import TrustedKeys, open_signed

log = logging.getLogger(__name__)


class Deployments:
    def __init__(
        self,
        settings: AgentSettings,
        store: LocalStore,
        keys: TrustedKeys,
        counters: Counter[str],
        *,
        serving: ServingState,
        report: Report,
    ) -> None:
        self.settings = settings
        self.store = store
        self.keys = keys
        self.counters = counters
        self._serving = serving
        self._deploy_lock = threading.Lock()
        self.reports = DeployReports(settings.edge, store, serving=serving, report=report)
        self.verdicts = LocalRollback(
            store,
            keys,
            counters,
            self.reports,
            policy=settings.probation_policy(),
            providers=settings.execution_providers,
            serving=serving,
            deploy_lock=self._deploy_lock,
            prune=self.prune,
        )
        # The serving model's probation (fed by the scorer), whose verdicts the rollback
        # carries out.
        self.probation = self.verdicts.probation

    @property
    def last_status(self) -> bytes | None:
        """The last deploy status, re-stated (retained) by every new session."""
        return self.reports.last_status

    @property
    def done_version(self) -> int:
        """The newest deployment version this station is done with (applied or failed)."""
        return int(self.store.get("deploy_done_version") or 0)

    # -- start-up

    def restore_active(self) -> runtime.LoadedModel | None:
        """The model to serve after a start: the active one if it still verifies, else the
        newest previous model that does (see :mod:`fedge.edge_agent.deploy.restore`)."""
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
            restore.candidates(active, history),
            lambda kept: restore.verify(kept, self.keys, self.settings.execution_providers),
        )
        for kept, failure in restored.failures:
            if kept is not active:
                log.error("kept model %s does not verify either: %s", kept.ref, failure)
        if restored.kept is not None:
            failed = self.probation.resume(restored.kept.ref, restored.kept.anomaly_ref)
            # A model on probation at every start (one that kills the agent) goes now,
            # before it serves; the status is published (retained) after the birth.
            rolled = None if failed is None else self.verdicts.roll_back(*failed)
            if rolled is not None:
                self.reports.last_status = rolled[1]
                if rolled[0] is not None:
                    self.prune()
                    return rolled[0]
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
            self.reports.last_status = payload

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
            self.reports.rejected(f"rejected {exc.reason}: {exc}")
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
                self.reports.stage(
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
                self._activate(desired, model)
            except DeployError as exc:
                self.counters[f"deploy.failed.{exc.reason}"] += 1
                log.error(
                    "deployment %s failed, still serving %r: %s",
                    desired.deployment_id,
                    self._serving.ref,
                    exc,
                )
                stage(DeployStage.FAILED, f"{exc.reason}: {exc.detail}")
                self.store.put("deploy_done_version", str(desired.version))
            self.prune()

    def _activate(self, desired: DeploymentDesired, model: runtime.LoadedModel) -> None:
        """Make ``model`` the one served, and start its trial, as one store transaction.

        The pointers, the trial, the done version and the ``active`` status commit
        together: a kill in between would otherwise leave the new model active with the
        deployment due again, re-applied with the model as its own previous one, and
        trusted unjudged.
        """
        kept = restore.kept_from(desired, model)
        writes: dict[str, str] = {}
        with self._serving.lock:
            previous = self._serving.ref
            serving_now = self._serving.model
            previous_anomaly = "" if serving_now is None else serving_now.anomaly_ref
            # The pair is what is judged (issue 28): a deployment that changes only the
            # anomaly model beside a classifier that serves already is a new model here.
            pair = pair_ref(model.ref, model.anomaly_ref)
            previous_pair = pair_ref(previous, previous_anomaly) if previous else ""
            proven = served.decode_proven(self.store.get(served.PROVEN))
            trial: Trial | None = None
            note = ""
            if previous_pair == pair:
                # The same pair again: a trial under way goes on, for this deployment.
                current = self.probation.current()
                if current is not None and current.pair == pair:
                    trial = replace(
                        current,
                        deployment_id=desired.deployment_id,
                        deployment_version=desired.version,
                    )
            elif not previous:
                # The station's first model: nothing to judge it against, nothing to go
                # back to; the reference for the models after it.
                writes[served.PROVEN] = served.add_proven(proven, pair)
            elif pair in proven:
                note = f"not on probation: {pair} is proven on this station"
            else:
                trial = self.probation.trial_for(
                    model,
                    desired.deployment_id,
                    desired.version,
                    previous,
                    baseline_trusted=previous_pair in proven,
                    previous_anomaly=previous_anomaly,
                )
            if trial is not None:
                note = f"on probation (previous {trial.previous_pair})"
            elif not note:
                note = (
                    "not on probation: the station's first model"
                    if not previous
                    else f"not on probation: {pair} serves already"
                )
            if model.anomaly is not None:
                note += f"; anomaly model {model.anomaly_ref} beside it"
            history = restore.decode_history(self.store.get("model_history"))
            configs = served.decode_configs(self.store.get(served.CONFIGS))
            payload = self.reports.status(
                desired.deployment_id,
                desired.version,
                (model.manifest.name, model.manifest.version),
                DeployStage.ACTIVE,
                note,
                model.ref,
            )
            # No trial, no verdict to wait for: the model is passed at once, and a staged
            # rollout waiting for the station's verdict gets it now (``passed`` implies
            # active at the manager; it is what a reconnect republishes).
            verdict = (
                None
                if trial is not None
                else self.reports.status(
                    desired.deployment_id,
                    desired.version,
                    (model.manifest.name, model.manifest.version),
                    DeployStage.PASSED,
                    note,
                    model.ref,
                )
            )
            writes.update(
                {
                    # The signed manifest and the deployment go with the pointer: a start
                    # re-verifies the model, and falls back to an earlier one if it fails.
                    "active_model": restore.encode_kept(kept),
                    "model_history": restore.encode_history(restore.remember(history, kept)),
                    PROBATION: "" if trial is None else encode_trial(trial),
                    served.CONFIGS: served.remember_config(
                        configs, self._serving.config, model.ref
                    ),
                    "deploy_done_version": str(desired.version),
                    "last_deploy_status": (payload if verdict is None else verdict).decode(),
                }
            )
            self.store.put_many(writes)
            self._serving.install(model)
            self.probation.start(trial)
        self.counters["deploy.active"] += 1
        log.info(
            "now serving %s%s",
            model.ref,
            f" with anomaly model {model.anomaly_ref}" if model.anomaly is not None else "",
        )
        self.reports.publish(payload)
        if verdict is not None:
            self.reports.publish(verdict)

    def config_writes(self, config: EdgeConfig) -> dict[str, str]:
        """What the store keeps when ``config`` is applied (with it, in one transaction):
        it is the config of the model it applies to, should the station go back to it."""
        configs = served.decode_configs(self.store.get(served.CONFIGS))
        return {served.CONFIGS: served.remember_config(configs, config, self._serving.ref)}

    @property
    def config_done_version(self) -> int:
        """The newest config version this station is done with: after a local rollback
        put an older config back in force, the one it replaced is not applied again."""
        return int(self.store.get(served.CONFIG_DONE) or 0)

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

"""A probation's verdict carried out: a pass recorded and reported, a failure rolled back.

:class:`LocalRollback` is the other half of :mod:`fedge.edge_agent.deploy.models` (the
same store, serving state and locks). It owns the probation
(:mod:`fedge.edge_agent.deploy.probation`) whose verdicts it carries out: the probation
calls :meth:`LocalRollback.passed` or :meth:`LocalRollback.rollback` on its own thread,
and the deployments call :meth:`LocalRollback.roll_back` at start-up for a trial the
agent restarted with too often.

A failed model goes back to the model its trial replaced (the pair: the classifier and
the anomaly model beside it, issue 28) -- never to another kept one
(the newest may be a model the manager moved this station away from), never to one
rolled back here -- and the config set for that model comes back with it
(:mod:`fedge.edge_agent.deploy.served`). Every rollback's state changes are one store
transaction: the pointers, the rolled-back deployment, the done versions, the config
and the ``rolled_back`` status.
"""

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from fedge.edge_agent.deploy import probation_verdict as health
from fedge.edge_agent.deploy import restore, served
from fedge.edge_agent.deploy.probation import KEY as PROBATION
from fedge.edge_agent.deploy.probation import Probation, Trial, pair_ref
from fedge.edge_agent.deploy.status import LAST, DeployReports, ref_of
from fedge.edge_agent.errors import DeployError
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.serving import ServingState
from fedge.edge_agent.store import LocalStore
from fedge.protocols import codec
from fedge.protocols.deployment import DeployStage
from fedge.protocols.signing import TrustedKeys

log = logging.getLogger(__name__)

# The deployments this agent rolled back (id -> reason), never activated again.
ROLLED_BACK = "rolled_back_deployments"


class LocalRollback:
    def __init__(
        self,
        store: LocalStore,
        keys: TrustedKeys,
        counters: Counter[str],
        reports: DeployReports,
        *,
        policy: health.ProbationPolicy,
        providers: Sequence[str] = runtime.DEFAULT_PROVIDERS,
        serving: ServingState,
        deploy_lock: threading.Lock,
        prune: Callable[[], None],
    ) -> None:
        self.store = store
        self.keys = keys
        self.providers = tuple(providers)
        self.counters = counters
        self.reports = reports
        self._serving = serving
        self._deploy_lock = deploy_lock
        self._prune = prune
        # Watches the serving model; its verdicts come back here, on threads of its own.
        self.probation = Probation(policy, store, counters, self.rollback, self.passed)

    def _still_active(self, trial: Trial) -> bool:
        """Whether ``trial``'s deployment is still the active one (none replaced it)."""
        raw = self.store.get("active_model")
        try:
            active = None if raw is None else restore.decode_kept(raw)
        except DeployError:
            return False
        return active is not None and (active.ref, active.deployment_id) == (
            trial.model,
            trial.deployment_id,
        )

    def passed(self, trial: Trial, verdict: health.Verdict) -> None:
        """``trial``'s model passed its probation: it is proven on this station, and the
        manager is told (``passed``; a staged rollout's health window may end before the
        probation does). Runs on its own thread (started by the probation)."""
        with self._deploy_lock:
            if not self._still_active(trial):
                self.counters["probation.pass_superseded"] += 1
                return
            payload = self.reports.status(
                trial.deployment_id,
                trial.deployment_version,
                ref_of(trial.model),
                DeployStage.PASSED,
                verdict.note,
                trial.model,
            )
            proven = served.decode_proven(self.store.get(served.PROVEN))
            self.store.put_many(
                {
                    PROBATION: "",
                    served.PROVEN: served.add_proven(proven, trial.pair),
                    LAST: payload.decode(),
                }
            )
            self.reports.publish(payload)

    def rollback(self, trial: Trial, verdict: health.Verdict) -> None:
        """``trial``'s model failed its probation: serve the model it replaced again.

        Runs on its own thread (started by the probation). Nothing happens if another
        deployment replaced the model meanwhile.
        """
        with self._deploy_lock:
            rolled = self.roll_back(trial, verdict)
            if rolled is None:
                return
            self.reports.publish(rolled[1])
            if rolled[0] is not None:
                self._prune()

    def roll_back(
        self, trial: Trial, verdict: health.Verdict
    ) -> tuple[runtime.LoadedModel | None, bytes] | None:
        """The rollback, but for publishing its status (returned with the model now
        served; None as the model: still the failed one). None when another deployment
        replaced the model meanwhile. Under the deploy lock, or at start-up."""
        if not self._still_active(trial):
            self.counters["rollback.superseded"] += 1
            return None
        active = restore.decode_kept(self.store.get("active_model") or "")
        history = restore.without(restore.decode_history(self.store.get("model_history")), active)
        earlier = restore.decode_rolled_back(self.store.get(ROLLED_BACK))
        target = restore.rollback_target(history, trial.previous, earlier, trial.previous_anomaly)
        restored = restore.restore(
            () if target is None else (target,),
            lambda kept: restore.verify(kept, self.keys, self.providers),
        )
        for kept, failure in restored.failures:
            log.error("kept model %s does not verify: %s", kept.ref, failure)
        ref = ref_of(trial.model)
        if restored.model is None or restored.kept is None:
            self.counters["rollback.no_previous"] += 1
            why = "is not kept" if target is None else "does not verify"
            reason = (
                f"health_check_failed: {verdict.reason}; the previous model "
                f"{trial.previous_pair or '(none)'} {why}, still serving {trial.pair}"
            )
            log.error("%s failed its probation but cannot roll back: %s", trial.model, reason)
            payload = self.reports.status(
                trial.deployment_id,
                trial.deployment_version,
                ref,
                DeployStage.FAILED,
                reason,
                trial.model,
            )
            self.store.put_many({PROBATION: "", LAST: payload.decode()})
            self.probation.start(None)
            return None, payload
        model, previous = restored.model, restored.kept
        # Under the agent's lock: no config is applied between the choice and the swap.
        with self._serving.lock:
            config_now = self._serving.config
            config = served.config_for(
                served.decode_configs(self.store.get(served.CONFIGS)), config_now, previous.ref
            )
            back_to = pair_ref(previous.ref, previous.anomaly_ref)
            reason = f"{verdict.reason}; serving {back_to} again"
            writes = {
                "active_model": restore.encode_kept(previous),
                "model_history": restore.encode_history(restore.remember(history, previous)),
                ROLLED_BACK: restore.encode_rolled_back(
                    restore.add_rolled_back(earlier, trial.deployment_id, verdict.reason)
                ),
                # The done version stays the bad deployment's: its retained desired
                # document is stale to this agent from now on, restarts included.
                "deploy_done_version": str(
                    max(int(self.store.get("deploy_done_version") or 0), trial.deployment_version)
                ),
                PROBATION: "",
            }
            if config is not None and config_now is not None:
                # The thresholds set for the previous model come back with it; the config
                # they replace is done with (not applied again), a newer one still wins.
                reason += f" with config v{config.version} (set for it), not v{config_now.version}"
                writes["applied_config"] = codec.encode(config).decode()
                writes[served.CONFIG_DONE] = str(
                    max(int(self.store.get(served.CONFIG_DONE) or 0), config_now.version)
                )
            payload = self.reports.status(
                trial.deployment_id,
                trial.deployment_version,
                ref,
                DeployStage.ROLLED_BACK,
                reason,
                previous.ref,
            )
            writes[LAST] = payload.decode()
            self.store.put_many(writes)
            self.probation.start(None)
            self._serving.install(model, config)
        self.counters["rollback.done"] += 1
        log.warning("rolled back from %s to %s: %s", trial.pair, back_to, verdict.reason)
        return model, payload

"""Watching the serving model: the baseline of its scores, and a new model's probation.

One :class:`Probation` per agent, fed by the scorer after every model call (scored
images, or a batch the model failed on). It keeps the serving model's recent defect
scores -- the baseline a next model's spread is compared with -- and, after a
deployment activates, the new model's probation window. The verdict is
:func:`fedge.edge_agent.deploy.probation_verdict.judge`'s; on ``failed`` the ``on_fail`` callback
(the
deployments' rollback) is started on its own thread, so scoring never waits for a swap;
on ``passed`` the ``on_pass`` callback (the deployments' report) likewise. A trial whose
time runs out while no image comes (an idle line) is judged by a timer at its end, so the
verdict -- which a staged rollout waits for -- comes on time whatever the line does.

The trial is kept in the agent's store (``probation``), written by the deployments in
the same transaction as the pointers that make the model active: an agent restarted
during a probation starts the window again for the same model rather than trusting it
unjudged, and counts the start in the trial. A model that kills the agent would
otherwise be resumed forever; past ``max_restarts`` starts :meth:`Probation.resume`
returns a failed verdict and the agent rolls back before it serves.

What is on trial is the pair served (issue 28): the classifier and the anomaly model
beside it. A deployment that changes only the anomaly model is a new trial, and a
failed one goes back to the previous pair -- the same classifier with the anomaly model
it had (:attr:`Trial.previous_anomaly`).
"""

import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from fedge.edge_agent.deploy import probation_verdict as health
from fedge.edge_agent.inference.runtime import LoadedModel
from fedge.edge_agent.store import LocalStore

log = logging.getLogger(__name__)

KEY = "probation"


@dataclass(frozen=True)
class Trial:
    """A model on probation: the deployment that activated it and the model it replaced."""

    model: str
    deployment_id: str
    deployment_version: int
    previous: str
    latency_budget_ms: float | None = None
    baseline_spread: float | None = None
    # How many times the agent was started with this trial under way (health.restarted).
    starts: int = 0
    # The anomaly model beside ``model`` and the one beside ``previous`` ("": none; issue
    # 28). None: a trial stored before pairs were judged (any anomaly model matches).
    anomaly: str | None = None
    previous_anomaly: str | None = None

    def matches(self, model: str, anomaly: str) -> bool:
        """Whether the pair ``model`` with ``anomaly`` beside it is the one on trial."""
        return self.model == model and self.anomaly in (None, anomaly)

    @property
    def pair(self) -> str:
        """The pair on trial as one ref (what the station's proven models record)."""
        return pair_ref(self.model, self.anomaly or "")

    @property
    def previous_pair(self) -> str:
        return pair_ref(self.previous, self.previous_anomaly or "")


def pair_ref(model: str, anomaly: str) -> str:
    """``inspect:3`` alone, or ``inspect:3+inspect-anomaly:1`` with an anomaly model."""
    return f"{model}+{anomaly}" if anomaly else model


def encode_trial(trial: Trial) -> str:
    return json.dumps(asdict(trial), separators=(",", ":"))


def decode_trial(raw: str | None) -> Trial | None:
    """The stored trial; None when there is none or it is unreadable (nothing to judge)."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
        return Trial(
            model=str(data["model"]),
            deployment_id=str(data["deployment_id"]),
            deployment_version=int(data["deployment_version"]),
            previous=str(data["previous"]),
            latency_budget_ms=_optional_float(data.get("latency_budget_ms")),
            baseline_spread=_optional_float(data.get("baseline_spread")),
            starts=int(data.get("starts", 0)),
            anomaly=_optional_str(data.get("anomaly")),
            previous_anomaly=_optional_str(data.get("previous_anomaly")),
        )
    except (ValueError, KeyError, TypeError):
        return None


def _optional_float(value: object) -> float | None:
    return None if value is None else float(str(value))


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)


# Called on its own thread with a judged trial (a failure: roll back; a pass: report).
OnVerdict = Callable[[Trial, health.Verdict], None]


class Probation:
    def __init__(
        self,
        policy: health.ProbationPolicy,
        store: LocalStore,
        counters: Counter[str],
        on_fail: OnVerdict,
        on_pass: OnVerdict,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.store = store
        self.counters = counters
        self._on_fail = on_fail
        self._on_pass = on_pass
        self._clock = clock
        self._lock = threading.Lock()
        # The serving model's last defect scores (the baseline of the next model).
        self._recent_model = ""
        self._recent: deque[float] = deque(maxlen=policy.images)
        self._trial: Trial | None = None
        self._window = health.Window()
        self._started = 0.0
        self._timer: threading.Timer | None = None
        self.last_verdict: health.Verdict | None = None

    # -- starting and ending a trial

    def trial_for(
        self,
        model: LoadedModel,
        deployment_id: str,
        deployment_version: int,
        previous: str,
        *,
        baseline_trusted: bool,
        previous_anomaly: str = "",
    ) -> Trial:
        """The trial of ``model`` about to replace ``previous`` (stored by the caller).

        The previous model's spread is the baseline only when ``baseline_trusted`` (it
        passed a probation here, or was the station's first model): a model is never
        judged against the scores of one that is itself unproven.
        """
        with self._lock:
            baseline = None
            if (
                baseline_trusted
                and self._recent_model == previous
                and len(self._recent) >= self.policy.min_images
            ):
                baseline = health.spread(list(self._recent))
        return Trial(
            model.ref,
            deployment_id,
            deployment_version,
            previous,
            model.manifest.latency_budget_ms,
            baseline,
            anomaly=model.anomaly_ref,
            previous_anomaly=previous_anomaly,
        )

    def current(self) -> Trial | None:
        with self._lock:
            return self._trial

    def start(self, trial: Trial | None) -> None:
        """``trial`` is under way (None: no trial), as the caller just stored it.

        Call it under the agent's lock, with the swap, so no image the new model scores
        escapes the window. A trial of the model already on trial (the same model
        deployed again) keeps its window: it is the same model's probation.
        """
        with self._lock:
            if trial is None:
                self._trial = None
                return
            if self._trial is not None and self._trial.pair == trial.pair:
                self._trial = trial
                return
            self._start(trial)
        log.info(
            "%s on probation (%d images or %.0f s; previous %s)",
            trial.pair,
            self.policy.images,
            self.policy.seconds,
            trial.previous_pair,
        )

    def resume(self, serving: str, anomaly: str = "") -> tuple[Trial, health.Verdict] | None:
        """At start-up: a trial of the model now serving starts its window again and
        counts the start; a trial of another model (the agent fell back at restore) is
        dropped. A trial started more than ``max_restarts`` times is returned failed:
        the caller rolls back before the model serves."""
        trial = decode_trial(self.store.get(KEY))
        if trial is None:
            return None
        with self._lock:
            if not trial.matches(serving, anomaly):
                self.store.put(KEY, "")
                return None
            trial = replace(trial, starts=trial.starts + 1)
            verdict = health.restarted(self.policy, trial.starts)
            if verdict is not None:
                self._trial = None
                self.last_verdict = verdict
            else:
                self.store.put(KEY, encode_trial(trial))
                self._start(trial)
        if verdict is not None:
            self.counters[f"probation.failed.{verdict.check}"] += 1
            log.error("%s failed its probation: %s", trial.model, verdict.reason)
            return trial, verdict
        self.counters["probation.resumed"] += 1
        return None

    def _start(self, trial: Trial) -> None:
        self._trial = trial
        self._window = health.Window()
        self._started = self._clock()
        self.last_verdict = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._clock is not time.monotonic:
            return  # an injected clock is moved by its owner, not by a wall-clock timer
        # A little after the window's end, so a last image at the edge is counted first.
        self._timer = threading.Timer(self.policy.seconds + 0.5, self._expire, args=(trial,))
        self._timer.daemon = True
        self._timer.name = "probation-timer"
        self._timer.start()

    def _expire(self, trial: Trial) -> None:
        """The trial's time is up with no image since: judge it on what it saw."""
        with self._lock:
            current = self._trial
            if current is None or current.pair != trial.pair:
                return  # judged by an image already, or replaced by another model's trial
            verdict = health.judge(
                self.policy,
                self._window,
                self._clock() - self._started,
                current.latency_budget_ms,
                current.baseline_spread,
            )
            if verdict.outcome is health.Outcome.PENDING:
                return  # an injected clock that has not moved (tests); images judge it
            self.last_verdict = verdict
            self._trial = None
        self._conclude(current, verdict)

    # -- what the scorer saw

    def observe(
        self,
        model: LoadedModel,
        rows: np.ndarray,
        latencies_ms: Sequence[float],
        errors: int,
        anomaly_unscored: Sequence[bool] = (),
    ) -> None:
        """One model call: the raw score rows of the images it scored (and their
        latencies), or ``errors`` images it failed on. ``anomaly_unscored``: per scored
        image, whether the anomaly model beside it gave no score (empty: none missing); a
        trial of a pair with an anomaly model counts those images as failed, and only as
        failed (the pair is judged whole, issue 28); other trials and the baseline do not
        (the classifier's records stand)."""
        indices = health.defect_indices(model.manifest.classes, model.manifest.positive_classes)
        scores, non_finite = health.defect_scores(rows, indices)
        with self._lock:
            if self._recent_model != model.ref:
                self._recent_model = model.ref
                self._recent.clear()
            self._recent.extend(scores)
            trial = self._trial
            if trial is None or not trial.matches(model.ref, model.anomaly_ref):
                return
            failed = 0
            if trial.anomaly and any(anomaly_unscored):
                # Each image once: a failed image's classifier score and latency stay out.
                kept = [not missing for missing in anomaly_unscored]
                failed = len(kept) - sum(kept)
                scores, non_finite = health.defect_scores(rows[np.asarray(kept)], indices)
                latencies_ms = [ms for ms, keep in zip(latencies_ms, kept, strict=True) if keep]
            self._window = health.observe(
                self._window,
                latencies_ms=latencies_ms,
                defect_scores=scores,
                non_finite=non_finite,
                errors=errors + failed,
            )
            verdict = health.judge(
                self.policy,
                self._window,
                self._clock() - self._started,
                trial.latency_budget_ms,
                trial.baseline_spread,
            )
            if verdict.outcome is health.Outcome.PENDING:
                return
            self.last_verdict = verdict
            self._trial = None  # judged once: later images change nothing
            if self._timer is not None:
                self._timer.cancel()  # nothing left for it to judge
                self._timer = None
        self._conclude(trial, verdict)

    def _conclude(self, trial: Trial, verdict: health.Verdict) -> None:
        """Hand a judged trial to its callback, on its own thread (outside the lock)."""
        if verdict.outcome is health.Outcome.PASSED:
            self.counters["probation.passed"] += 1
            log.info("%s passed its probation: %s", trial.model, verdict.note)
            target, name = self._on_pass, "probation-passed"
        else:
            self.counters[f"probation.failed.{verdict.check}"] += 1
            log.error("%s failed its probation: %s", trial.model, verdict.reason)
            target, name = self._on_fail, "rollback"
        # The trial leaves the store there, with what the verdict changes (one transaction).
        threading.Thread(target=target, args=(trial, verdict), name=name, daemon=True).start()

    def status(self) -> dict[str, object]:
        """For the local API: the trial under way, or the last verdict."""
        with self._lock:
            trial, window, started = self._trial, self._window, self._started
            last = self.last_verdict
        if trial is None:
            return {
                "state": "none" if last is None else last.outcome.value,
                "reason": "" if last is None else last.reason,
            }
        return {
            "state": "on_probation",
            "model": trial.model,
            "previous": trial.previous,
            "anomaly": trial.anomaly,
            "previous_anomaly": trial.previous_anomaly,
            "images": window.attempts,
            "of_images": self.policy.images,
            "elapsed_s": round(self._clock() - started, 3),
            "of_seconds": self.policy.seconds,
            "latency_budget_ms": trial.latency_budget_ms,
            "baseline_spread": trial.baseline_spread,
            "starts": trial.starts,
        }

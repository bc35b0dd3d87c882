"""The continuous-training runner: trigger, then job -> gate -> rollout, every step stored.

``fedge loop run`` calls :meth:`LoopRunner.tick` periodically (``--once``: one pass).
A pass first carries every unfinished run on from its stored state (a runner killed
mid-job resumes the fleet job from its checkpoint; mid-rollout it follows the rollout the
manager's driver kept going), then asks each enabled policy whether a new run is due
(:func:`fedge.loop.policy.decide`). The gate and the rollout are reached through two
small protocols (:mod:`fedge.loop.steps` wires them to the manager's gate and rollout
driver) so the sequencing here is tested on its own.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from fedge.aggregator.jobs.directory import RUNS_DB
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.operations import opened
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.store import Store
from fedge.errors import FedgeError
from fedge.federation import fleet_job
from fedge.loop import run_store
from fedge.loop.pipeline import (
    Event,
    Gated,
    JobFailed,
    LoopRun,
    Published,
    RolloutEnded,
    RolloutStarted,
    RunState,
    StepFailed,
    advance,
)
from fedge.loop.policy import LoopPolicy, decide, job_for

log = logging.getLogger(__name__)
T = TypeVar("T")


class GateStep(Protocol):
    def __call__(self, candidate: str) -> tuple[bool, str]:
        """Evaluate ``candidate`` at the stations: (blessed, why)."""
        ...


class RolloutStep(Protocol):
    def start(self, candidate: str, policy: LoopPolicy) -> str:
        """Start a staged rollout of ``candidate`` as the policy says; its id."""
        ...

    def find(self, candidate: str) -> str | None:
        """The newest rollout of ``candidate`` already started, if any."""
        ...

    def outcome(self, rollout_id: str) -> tuple[bool | None, str]:
        """None while it runs; True once completed; False once aborted or rolled back."""
        ...


@dataclass(frozen=True)
class Wiring:
    gate: GateStep
    rollout: RolloutStep
    job_timeout_s: float = 3600.0
    rollout_poll_s: float = 1.0
    rollout_timeout_s: float = 6 * 3600.0


class LoopRunner:
    def __init__(self, home: ManagerHome, wiring: Wiring) -> None:
        self.home = home
        self.wiring = wiring
        self.counters: Counter[str] = Counter()

    def tick(self, now: float | None = None) -> list[LoopRun]:
        """One pass: finish what was started, then start what is due. Returns the runs
        this pass touched, as they ended up."""
        touched = []
        for run in self._with_store(run_store.unfinished):
            touched.append(self.drive(run))
        for policy in self._with_store(run_store.policies):
            seen = self._with_store(functools.partial(run_store.observe, model=policy.model))
            decision = decide(policy, seen, time.time() if now is None else now)
            if not decision.start:
                continue
            run = self.start(policy, decision.reason)
            touched.append(self.drive(run))
        return touched

    def start(self, policy: LoopPolicy, trigger: str) -> LoopRun:
        run = run_store.new_run(policy.model, trigger, time.time())
        job_dir = self.home.root / "loop" / run.run_id
        run = LoopRun(**{**run.__dict__, "job_dir": str(job_dir)})
        self._save(run, "triggered", trigger)
        self.counters["runs.started"] += 1
        log.info("loop run %s of %s starts: %s", run.run_id, policy.model, trigger)
        return run

    def drive(self, run: LoopRun) -> LoopRun:
        """Carry ``run`` through its steps until it ends."""
        while not run.state.ended:
            policy = self._with_store(functools.partial(run_store.policy, model=run.model))
            if policy is None:
                event: Event = StepFailed(f"the loop policy of {run.model} was removed")
            else:
                event = self._step(run, policy)
            run = advance(run, event, time.time())
            self._save(run, _step_name(event), _detail(event))
        self.counters[f"runs.{run.state.value}"] += 1
        return run

    def _step(self, run: LoopRun, policy: LoopPolicy) -> Event:
        try:
            if run.state is RunState.TRAINING:
                return self._train(run, policy)
            if run.state is RunState.GATING:
                blessed, why = self.wiring.gate(run.candidate)
                return Gated(blessed, why)
            if not run.rollout_id:
                # A runner killed between starting the rollout and storing its id finds
                # it again (the candidate is this run's own): never a second rollout.
                started = self.wiring.rollout.find(run.candidate)
                if started is None:
                    started = self.wiring.rollout.start(run.candidate, policy)
                return RolloutStarted(started)
            return self._follow(run)
        except (FedgeError, OSError) as exc:
            return StepFailed(f"{run.state.value}: {exc}")

    def _train(self, run: LoopRun, policy: LoopPolicy) -> Event:
        job_dir = Path(run.job_dir)
        if (job_dir / RUNS_DB).exists():  # started before: resume from its checkpoint
            result = fleet_job.resume_fleet_job(
                job_dir, self.home, timeout_s=self.wiring.job_timeout_s
            )
        else:
            start = _start_model(self.home, policy.model)
            manifest = job_dir.with_suffix(".toml")
            manifest.parent.mkdir(parents=True, exist_ok=True)
            manifest.write_text(job_for(policy.job, start), encoding="utf-8")
            result = fleet_job.run_fleet_job(
                manifest, job_dir, self.home, timeout_s=self.wiring.job_timeout_s
            )
        if result.published:
            return Published(result.published)
        return JobFailed(result.error or f"the job ended {result.state.value}")

    def _follow(self, run: LoopRun) -> Event:
        deadline = time.monotonic() + self.wiring.rollout_timeout_s
        while time.monotonic() < deadline:
            done, why = self.wiring.rollout.outcome(run.rollout_id)
            if done is not None:
                return RolloutEnded(done, why)
            time.sleep(self.wiring.rollout_poll_s)
        return StepFailed(f"rollout {run.rollout_id} did not end within the loop's limit")

    def _save(self, run: LoopRun, step: str, detail: str) -> None:
        self._with_store(lambda s: run_store.save_run(s, run, step, detail))

    def _with_store(self, use: Callable[[Store], T]) -> T:
        store = Store(self.home.db_path)
        try:
            return use(store)
        finally:
            store.close()


def _start_model(home: ManagerHome, name: str) -> str:
    """The version of ``name`` most edges are deployed with; else the newest published."""
    with opened(home) as fleet:
        deployed = Counter(
            ref for edge in fleet.edges() if (ref := fleet.deployed_model(edge)) is not None
        )
        serving = [(n, v) for (n, v), _ in deployed.most_common() if n == name]
        if serving:
            return f"{name}:{serving[0][1]}"
        latest = fleet.registry.latest_version(name)
    if latest is None:
        raise ManagerError(f"no version of model {name!r} is published; nothing to train from")
    return f"{name}:{latest}"


def _step_name(event: Event) -> str:
    return {
        Published: "published",
        JobFailed: "job_failed",
        Gated: "gated",
        RolloutStarted: "rollout_started",
        RolloutEnded: "rollout_ended",
        StepFailed: "failed",
    }[type(event)]


def _detail(event: Event) -> str:
    match event:
        case Published(candidate):
            return candidate
        case Gated(blessed, reason):
            return ("blessed" if blessed else "not blessed") + (f": {reason}" if reason else "")
        case RolloutStarted(rollout_id):
            return rollout_id
        case RolloutEnded(completed, reason):
            return ("completed" if completed else "rolled back") + (f": {reason}" if reason else "")
        case JobFailed(error) | StepFailed(error):
            return error
    return ""

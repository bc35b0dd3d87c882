"""The manager's job queue carried out on fleet jobs (issue 31): observe, decide, act.

Each :meth:`QueueRunner.step`:

1. **observes** every job that holds stations through :class:`FleetJobs` (a
   :class:`RunView` of its run):

   - a finished run becomes ``completed`` (its model published) or ``failed``;
   - a job asked to stop (``suspending``, ``cancelling``) is asked again (the request
     is idempotent, so one recorded before a crash is still made); once its run halted
     at a round boundary -- its checkpoint written -- or its aggregator is gone, it is
     ``suspended`` or ``cancelled`` and its stations are free. Past its grace period
     the run is stopped (FitGpp's grace period bounds the wait) and resumes from its
     newest checkpoint, the unfinished round played again and recorded once;
   - a ``running`` job whose run is not running is carried out again: never prepared
     (the manager died between recording a start and making it) -> started; halted
     *before* it was (re)started, or its aggregator gone -> submitted again. The store
     said ``running`` first, so nothing is started twice. Only a halt *after* the job
     was started is someone else's (``fedge aggregator halt``): recorded as a
     suspension, so the job keeps its place and its checkpoint;
2. **decides** (:func:`fedge.edge_manager.scheduler.service.tick`, stations pinned: a
   fleet job resumes only on the stations its checkpoint's party map names);
3. **acts**: starts, resumes, and asks the chosen BE jobs -- and jobs with a station
   that left its training window -- to halt after their current round. A start or
   resume the fleet refuses fails the job, with the reason; the queue goes on.

:class:`FleetJobs` is the boundary: :class:`InMemoryFleetJobs` (here, shipped as
library code for tests and the simulator) and
:class:`fedge.federation.link_jobs.SuperLinkJobs` (the fleet's SuperLink).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fedge.aggregator.jobs.run_store import RunState
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.lifecycle import HOLDING, JobState
from fedge.edge_manager.scheduler.policy import Policy
from fedge.edge_manager.scheduler.queue import Actions, Station
from fedge.edge_manager.scheduler.service import SCHEDULER, round_boundary, tick
from fedge.edge_manager.scheduler.store import JobRecord
from fedge.edge_manager.store import Store
from fedge.errors import FedgeError

log = logging.getLogger(__name__)

STOPPING = (JobState.SUSPENDING, JobState.CANCELLING)


@dataclass(frozen=True)
class RunView:
    """A job's run as the runner needs it."""

    state: RunState
    updated_at: float  # when its state last changed (the runner's clock)
    live: bool  # an aggregator runs it, or one was just submitted and may still take it


class FleetJobs(Protocol):
    """What the queue needs from the fleet-job machinery, per job (``record.job_dir``)."""

    def start(self, record: JobRecord, stations: tuple[str, ...]) -> None:
        """Prepare the job on ``stations`` and submit it."""

    def resume(self, record: JobRecord) -> None:
        """Submit it again to continue from its newest checkpoint."""

    def halt(self, record: JobRecord) -> None:
        """Ask it to stop after its current round (and checkpoint); asking twice is once."""

    def force_stop(self, record: JobRecord) -> None:
        """Its grace period is spent: stop its aggregator now (the newest checkpoint stays)."""

    def view(self, record: JobRecord) -> RunView | None:
        """Its run (None: never prepared)."""

    def completed(self, record: JobRecord) -> str:
        """Its run completed: publish its model; returns what to note in the audit log."""


class QueueRunner:
    def __init__(
        self,
        store: Store,
        jobs: FleetJobs,
        policy: Policy,
        stations: Callable[[], Sequence[Station]],
    ) -> None:
        self.store = store
        self.jobs = jobs
        self.policy = policy
        self.stations = stations

    def step(self, now: float) -> Actions:
        for record in queue_store.jobs(self.store, states=tuple(HOLDING)):
            self._observe(record, now)
        actions = tick(self.store, self.policy, self.stations(), now, pin_stations=True)
        for placement in actions.start:
            record = queue_store.job(self.store, placement.job_id)
            self._carry_out(record, now, self._start_on(placement.stations))
        for placement in actions.resume:
            record = queue_store.job(self.store, placement.job_id)
            self._carry_out(record, now, self._resume)
        stopping = {s.job_id for s in actions.suspend} | {d.job_id for d in actions.drop}
        for job_id in sorted(stopping):
            record = queue_store.job(self.store, job_id)
            if record.state in STOPPING:
                self._ask_to_stop(record)
        return actions

    # -- observe

    def _observe(self, record: JobRecord, now: float) -> None:
        run = self.jobs.view(record)
        if run is not None and run.state in (RunState.COMPLETED, RunState.FAILED):
            self._ended(record, run.state, now)
        elif record.state in STOPPING:
            self._stopping(record, run, now)
        elif run is None:
            self._carry_out(record, now, self._start_on(record.assigned))
        elif run.state is RunState.HALTED and run.updated_at >= (record.started_at or 0.0):
            self._transition(record, JobState.SUSPENDING, now, "halted outside the scheduler")
            round_boundary(self.store, record.job.job_id, now=now, detail="halted at a round")
        elif run.state is RunState.HALTED or not run.live:
            # Halted before this (re)start, or its aggregator died: the start or resume
            # the store records was not carried out (or not to the end). Do it now; it
            # is no suspension, and the job's preemption count stays.
            self._carry_out(record, now, self._resume)

    def _stopping(self, record: JobRecord, run: RunView | None, now: float) -> None:
        job_id = record.job.job_id
        if run is None:
            round_boundary(self.store, job_id, now=now, detail="stopped before it was prepared")
            return
        if run.state is RunState.HALTED or not run.live:
            detail = (
                "halted at a round boundary"
                if run.live or run.state is RunState.HALTED
                else ("its aggregator is gone; it resumes from its newest checkpoint")
            )
            round_boundary(self.store, job_id, now=now, detail=detail)
            return
        self._ask_to_stop(record)
        asked_at = record.updated_at
        if now - asked_at < record.job.grace_s:
            return
        log.warning("job %s: grace period %.0f s spent; stopping it", job_id, record.job.grace_s)
        try:
            self.jobs.force_stop(record)
        except FedgeError as exc:
            log.warning("job %s: could not stop it: %s", job_id, exc)
            return
        after = self.jobs.view(record)
        if after is None or after.state is RunState.HALTED or not after.live:
            round_boundary(
                self.store,
                job_id,
                now=now,
                detail=f"grace period {record.job.grace_s:g} s spent: stopped mid-round; "
                "it resumes from its newest checkpoint",
            )

    def _ended(self, record: JobRecord, state: RunState, now: float) -> None:
        if state is RunState.FAILED:
            self._transition(record, JobState.FAILED, now, "run failed")
            return
        try:
            detail = self.jobs.completed(record)
        except FedgeError as exc:
            self._transition(record, JobState.FAILED, now, f"completed, not published: {exc}")
            return
        self._transition(record, JobState.COMPLETED, now, detail)

    # -- act

    def _start_on(self, stations: tuple[str, ...]) -> Callable[[JobRecord], None]:
        return lambda record: self.jobs.start(record, stations)

    def _resume(self, record: JobRecord) -> None:
        if self.jobs.view(record) is None:  # suspended before it was ever prepared
            self.jobs.start(record, record.assigned)
        else:
            self.jobs.resume(record)

    def _carry_out(self, record: JobRecord, now: float, act: Callable[[JobRecord], None]) -> None:
        try:
            act(record)
        except FedgeError as exc:
            log.warning("job %s: the fleet refused it: %s", record.job.job_id, exc)
            self._transition(record, JobState.FAILED, now, f"refused by the fleet: {exc}")

    def _ask_to_stop(self, record: JobRecord) -> None:
        try:
            self.jobs.halt(record)
        except FedgeError as exc:  # it ended meanwhile: the next observation records how
            log.info("job %s: halt not needed: %s", record.job.job_id, exc)

    def _transition(self, record: JobRecord, new: JobState, now: float, detail: str) -> None:
        queue_store.transition(
            self.store, record.job.job_id, new, who=SCHEDULER, at=now, detail=detail
        )


@dataclass
class InMemoryFleetJobs:
    """:class:`FleetJobs` without processes: a job runs until :meth:`finish`; a halt
    request takes effect at :meth:`round_ends`. Counts submissions per job."""

    states: dict[str, RunState] = field(default_factory=dict)
    updated_at: dict[str, float] = field(default_factory=dict)
    stations: dict[str, tuple[str, ...]] = field(default_factory=dict)
    submissions: dict[str, int] = field(default_factory=dict)
    halt_requested: set[str] = field(default_factory=set)
    rounds: dict[str, int] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)  # aggregators killed
    forced: list[str] = field(default_factory=list)
    published: list[str] = field(default_factory=list)

    def start(self, record: JobRecord, stations: tuple[str, ...]) -> None:
        job_id = record.job.job_id
        self.stations[job_id] = stations
        self._submit(job_id)

    def resume(self, record: JobRecord) -> None:
        self.halt_requested.discard(record.job.job_id)
        self._submit(record.job.job_id)

    def halt(self, record: JobRecord) -> None:
        self.halt_requested.add(record.job.job_id)

    def force_stop(self, record: JobRecord) -> None:
        job_id = record.job.job_id
        self.forced.append(job_id)
        self.halt_requested.discard(job_id)
        self.states[job_id] = RunState.HALTED

    def view(self, record: JobRecord) -> RunView | None:
        job_id = record.job.job_id
        state = self.states.get(job_id)
        if state is None:
            return None
        return RunView(state, self.updated_at.get(job_id, 0.0), job_id not in self.dead)

    def completed(self, record: JobRecord) -> str:
        self.published.append(record.job.job_id)
        return "run completed"

    def _submit(self, job_id: str) -> None:
        self.dead.discard(job_id)
        self.states[job_id] = RunState.RUNNING
        self.submissions[job_id] = self.submissions.get(job_id, 0) + 1

    # -- what the fleet does

    def round_ends(self, job_id: str, at: float = 0.0) -> None:
        self.rounds[job_id] = self.rounds.get(job_id, 0) + 1
        if job_id in self.halt_requested:
            self.halt_requested.discard(job_id)
            self.states[job_id] = RunState.HALTED
            self.updated_at[job_id] = at

    def operator_halt(self, job_id: str, at: float) -> None:
        """``fedge aggregator halt`` outside the scheduler, taking effect at ``at``."""
        self.states[job_id] = RunState.HALTED
        self.updated_at[job_id] = at

    def finish(self, job_id: str, state: RunState = RunState.COMPLETED) -> None:
        self.states[job_id] = state

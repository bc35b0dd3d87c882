"""The manager's job queue carried out on fleet jobs (issue 31): observe, decide, act.

Each :meth:`QueueRunner.step`:

1. **observes** every job that holds stations through :class:`FleetJobs` (the run store
   of its job directory): a finished run becomes ``completed`` or ``failed``; a run that
   halted after the scheduler asked it to stop has reached its round boundary (its
   checkpoint written): ``suspended`` or ``cancelled``, and its stations are free; a run
   halted by someone else (``fedge aggregator halt``) is recorded as suspended too, so it
   keeps its place and its checkpoint; a ``running`` job nobody runs (the manager died
   between recording a start and submitting it) is submitted again -- the store said
   ``running`` first, so it is never started twice;
2. **decides** (:func:`fedge.edge_manager.scheduler.service.tick`, stations pinned: a
   fleet job resumes only on the stations its checkpoint's party map names);
3. **acts**: starts, resumes, and asks the chosen BE jobs to halt after their current
   round (FitGpp's suspension: the grace period is the time to finish the round).

:class:`FleetJobs` is the boundary. :class:`InMemoryFleetJobs` is its twin, shipped as
library code for tests and the simulator. The adapter onto the real machinery
(``federation.prepare`` with the assigned stations as ``[federation] edges``,
``fleet_job.submit_to_fleet``, ``aggregator.jobs.control.halt_job``, the run store's
state) is the next step and not written yet (issue 31, "real fleet").
"""

from __future__ import annotations

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


class FleetJobs(Protocol):
    """What the queue needs from the fleet-job machinery, per job (``record.job_dir``)."""

    def start(self, record: JobRecord, stations: tuple[str, ...]) -> None:
        """Prepare the job on ``stations`` and submit it."""

    def resume(self, record: JobRecord) -> None:
        """Submit it again to continue from its newest checkpoint."""

    def halt(self, record: JobRecord) -> None:
        """Ask it to stop after its current round (and checkpoint)."""

    def state(self, record: JobRecord) -> RunState | None:
        """Its run's state (None: never prepared)."""

    def ensure_running(self, record: JobRecord) -> None:
        """Submit it again if no aggregator runs it (and none is about to)."""


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
        self._observe(now)
        actions = tick(self.store, self.policy, self.stations(), now, pin_stations=True)
        for placement in actions.start:
            self.jobs.start(queue_store.job(self.store, placement.job_id), placement.stations)
        for placement in actions.resume:
            self.jobs.resume(queue_store.job(self.store, placement.job_id))
        for suspension in actions.suspend:
            self.jobs.halt(queue_store.job(self.store, suspension.job_id))
        return actions

    def _observe(self, now: float) -> None:
        for record in queue_store.jobs(self.store, states=tuple(HOLDING)):
            run = self.jobs.state(record)
            job_id = record.job.job_id
            if run is RunState.COMPLETED or run is RunState.FAILED:
                ended = JobState.COMPLETED if run is RunState.COMPLETED else JobState.FAILED
                queue_store.transition(
                    self.store, job_id, ended, who=SCHEDULER, at=now, detail=f"run {run.value}"
                )
            elif run is RunState.HALTED:
                if record.state is JobState.RUNNING:
                    queue_store.transition(
                        self.store,
                        job_id,
                        JobState.SUSPENDING,
                        who=SCHEDULER,
                        at=now,
                        detail="halted outside the scheduler",
                    )
                round_boundary(self.store, job_id, now=now, detail="halted at a round boundary")
            elif record.state is JobState.RUNNING:
                self.jobs.ensure_running(record)


@dataclass
class InMemoryFleetJobs:
    """:class:`FleetJobs` without processes: a job runs until :meth:`finish`; a halt
    request takes effect at :meth:`round_ends`. Counts submissions per job."""

    states: dict[str, RunState] = field(default_factory=dict)
    stations: dict[str, tuple[str, ...]] = field(default_factory=dict)
    submissions: dict[str, int] = field(default_factory=dict)
    halt_requested: set[str] = field(default_factory=set)
    rounds: dict[str, int] = field(default_factory=dict)

    def start(self, record: JobRecord, stations: tuple[str, ...]) -> None:
        job_id = record.job.job_id
        self.stations[job_id] = stations
        self._submit(job_id)

    def resume(self, record: JobRecord) -> None:
        self.halt_requested.discard(record.job.job_id)
        self._submit(record.job.job_id)

    def halt(self, record: JobRecord) -> None:
        self.halt_requested.add(record.job.job_id)

    def state(self, record: JobRecord) -> RunState | None:
        return self.states.get(record.job.job_id)

    def ensure_running(self, record: JobRecord) -> None:
        if record.job.job_id not in self.states:
            self.start(record, record.assigned)

    def _submit(self, job_id: str) -> None:
        self.states[job_id] = RunState.RUNNING
        self.submissions[job_id] = self.submissions.get(job_id, 0) + 1

    # -- what the fleet does

    def round_ends(self, job_id: str) -> None:
        self.rounds[job_id] = self.rounds.get(job_id, 0) + 1
        if job_id in self.halt_requested:
            self.halt_requested.discard(job_id)
            self.states[job_id] = RunState.HALTED

    def finish(self, job_id: str, state: RunState = RunState.COMPLETED) -> None:
        self.states[job_id] = state

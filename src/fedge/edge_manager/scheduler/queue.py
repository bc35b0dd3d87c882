"""The scheduler's values: jobs, stations, what waits and what runs, and the actions.

All frozen, validated at construction. A job asks for ``demand`` distinct stations (one
training slot on each), chosen from ``stations`` (``None``: any station of the fleet; a
job that needs *all* of a list names the list and sets ``demand`` to its length).

Kinds follow FitGpp (Yabuuchi, Taniwaki, Omura, "Low-latency Job Scheduling with
Preemption for the Development of Deep Learning", OpML'19): trial-and-error (``te``)
jobs are urgent and may suspend running best-effort (``be``) jobs; a suspended job
gets its grace period to finish its current round and checkpoint, then waits at the
head of the best-effort queue and resumes from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.windows import Window

if TYPE_CHECKING:
    from fedge.edge_manager.scheduler.policy import Policy


class JobKind(StrEnum):
    TE = "te"  # trial-and-error: urgent, may preempt best-effort jobs
    BE = "be"  # best-effort: may be suspended at a round boundary


@dataclass(frozen=True)
class Job:
    job_id: str
    kind: JobKind
    team: str
    demand: int
    submitted_at: float
    grace_s: float
    stations: frozenset[str] | None = None
    max_preemptions: int = 1
    priority: int = 0
    # Only LRTP reads it (FitGpp needs no run-time estimate, which is its point).
    expected_run_s: float | None = None

    def __post_init__(self) -> None:
        if not self.job_id:
            raise SchedulerError("a job needs an id")
        if not self.team:
            raise SchedulerError(f"job {self.job_id}: name the team that submits it")
        if self.demand < 1:
            raise SchedulerError(f"job {self.job_id}: it must need at least 1 station")
        if self.grace_s <= 0:
            raise SchedulerError(
                f"job {self.job_id}: grace period {self.grace_s} s must be > 0 (the time "
                "to finish a round and checkpoint)"
            )
        if self.max_preemptions < 0:
            raise SchedulerError(f"job {self.job_id}: max preemptions must be 0 or more")
        if self.stations is not None and len(self.stations) < self.demand:
            raise SchedulerError(
                f"job {self.job_id}: it needs {self.demand} stations but names only "
                f"{len(self.stations)}; name more stations or need fewer"
            )


@dataclass(frozen=True)
class Station:
    station_id: str
    slots: int = 1
    windows: tuple[Window, ...] = ()
    utc_offset_s: int = 0
    idle_since: float | None = None  # reported by the agent; None: the line is busy

    def __post_init__(self) -> None:
        if self.slots < 0:
            raise SchedulerError(f"station {self.station_id}: training slots must be >= 0")


@dataclass(frozen=True)
class Queued:
    """A job waiting: new (``preemptions == 0``) or suspended and waiting to resume."""

    job: Job
    queued_at: float
    waited_s: float = 0.0  # queued time before ``queued_at`` (earlier stints)
    ran_s: float = 0.0  # run time done before it was suspended
    preemptions: int = 0


@dataclass(frozen=True)
class Running:
    job: Job
    stations: tuple[str, ...]
    started_at: float
    waited_s: float = 0.0  # total queued time before this start
    ran_s: float = 0.0  # run time done before this start
    preemptions: int = 0
    suspending: bool = False  # asked to stop after its round; still holds its stations


@dataclass(frozen=True)
class State:
    """A snapshot: the fleet's stations, the queue (in :func:`~.policy.queue_key` order)
    and the running jobs. ``team_remaining_s``: station-seconds each team may still use
    today (a team absent has no quota)."""

    policy: Policy
    stations: Sequence[Station]
    queue: Sequence[Queued]
    running: Sequence[Running]
    team_remaining_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    job_id: str
    stations: tuple[str, ...]


@dataclass(frozen=True)
class Suspension:
    """Stop ``job_id`` after its current round and checkpoint, to make room for ``for_job``."""

    job_id: str
    for_job: str


@dataclass(frozen=True)
class StationDrop:
    """``station_id`` left its window: ``job_id`` finishes the round there, then stops
    asking it until the window opens again."""

    job_id: str
    station_id: str


@dataclass(frozen=True)
class Actions:
    start: tuple[Placement, ...] = ()
    resume: tuple[Placement, ...] = ()
    suspend: tuple[Suspension, ...] = ()
    drop: tuple[StationDrop, ...] = ()

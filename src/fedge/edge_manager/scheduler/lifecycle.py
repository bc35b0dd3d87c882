"""A queued job's states and the changes allowed between them (FfDL's job lifecycle,
with FitGpp's suspension: running -> suspending -> suspended -> running).

``suspending``: asked to stop after its current round and checkpoint (it still holds its
stations, for at most its grace period). ``cancelling``: cancelled while running; it
frees its stations at the next round boundary, then becomes ``cancelled``.
"""

from enum import StrEnum

from fedge.edge_manager.scheduler.errors import SchedulerError


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    FAILED = "failed"


_ENDS = {JobState.COMPLETED, JobState.FAILED}
ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.SUSPENDING, JobState.CANCELLING, *_ENDS}),
    JobState.SUSPENDING: frozenset({JobState.SUSPENDED, JobState.CANCELLING, *_ENDS}),
    JobState.SUSPENDED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.CANCELLING: frozenset({JobState.CANCELLED, *_ENDS}),
    JobState.CANCELLED: frozenset(),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
}
WAITING = frozenset({JobState.QUEUED, JobState.SUSPENDED})
HOLDING = frozenset({JobState.RUNNING, JobState.SUSPENDING, JobState.CANCELLING})


def check_transition(job_id: str, current: JobState, new: JobState) -> None:
    if new not in ALLOWED[current]:
        raise SchedulerError(
            f"job {job_id} is {current.value}; it cannot become {new.value}"
            + (" (it has ended)" if not ALLOWED[current] else "")
        )


def cancel_target(current: JobState) -> JobState:
    """What ``cancel`` makes of a job: waiting jobs end now, running ones at the next
    round boundary."""
    return JobState.CANCELLED if current in WAITING else JobState.CANCELLING

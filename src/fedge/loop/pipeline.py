"""One continuous-training run: train across the fleet, gate, roll out -- as states.

::

    training --published--> gating --blessed--> rolling_out --completed--> completed
        |                      |                     |
        +--failed--> failed    +--refused--> not_blessed
                                                     +--aborted--> rolled_back

Every transition is a pure function of the run and what happened
(:func:`advance`); the runner stores the run after each one, so a runner killed
anywhere resumes from the step it was in (a fleet job resumes from its checkpoint, a
gate is asked again, a rollout is followed where the manager's driver has it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum


class RunState(StrEnum):
    TRAINING = "training"
    GATING = "gating"
    ROLLING_OUT = "rolling_out"
    COMPLETED = "completed"
    NOT_BLESSED = "not_blessed"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in _ENDED


_ENDED = frozenset(
    {RunState.COMPLETED, RunState.NOT_BLESSED, RunState.ROLLED_BACK, RunState.FAILED}
)


@dataclass(frozen=True)
class LoopRun:
    run_id: str
    model: str
    state: RunState
    trigger: str
    started_at: float
    updated_at: float
    job_dir: str = ""
    candidate: str = ""  # "inspect:5" once the job published it
    rollout_id: str = ""
    reason: str = ""  # why it ended as it did


@dataclass(frozen=True)
class Published:
    candidate: str


@dataclass(frozen=True)
class JobFailed:
    error: str


@dataclass(frozen=True)
class Gated:
    blessed: bool
    reason: str


@dataclass(frozen=True)
class RolloutStarted:
    rollout_id: str


@dataclass(frozen=True)
class RolloutEnded:
    completed: bool
    reason: str


@dataclass(frozen=True)
class StepFailed:
    """A step could not be carried out (e.g. the rollout was refused): the run ends."""

    error: str


Event = Published | JobFailed | Gated | RolloutStarted | RolloutEnded | StepFailed


class PipelineError(ValueError):
    """An event that cannot happen in the run's state (a bug in the caller)."""


def advance(run: LoopRun, event: Event, now: float) -> LoopRun:
    """The run after ``event``; raises :class:`PipelineError` if it does not fit the state."""
    if run.state.ended:
        raise PipelineError(f"loop run {run.run_id} already ended ({run.state.value})")
    change: dict[str, object]
    match event, run.state:
        case Published(candidate), RunState.TRAINING:
            change = {"state": RunState.GATING, "candidate": candidate}
        case JobFailed(error), RunState.TRAINING:
            change = {"state": RunState.FAILED, "reason": f"the fleet job failed: {error}"}
        case Gated(True, _), RunState.GATING:
            change = {"state": RunState.ROLLING_OUT}
        case Gated(False, reason), RunState.GATING:
            change = {"state": RunState.NOT_BLESSED, "reason": reason}
        case RolloutStarted(rollout_id), RunState.ROLLING_OUT:
            change = {"rollout_id": rollout_id}
        case RolloutEnded(True, _), RunState.ROLLING_OUT:
            change = {"state": RunState.COMPLETED, "reason": ""}
        case RolloutEnded(False, reason), RunState.ROLLING_OUT:
            change = {"state": RunState.ROLLED_BACK, "reason": reason}
        case StepFailed(error), _:
            change = {"state": RunState.FAILED, "reason": error}
        case _:
            raise PipelineError(
                f"{type(event).__name__} does not fit loop run {run.run_id} in state "
                f"{run.state.value}"
            )
    return dataclasses.replace(run, updated_at=now, **change)  # type: ignore[arg-type]

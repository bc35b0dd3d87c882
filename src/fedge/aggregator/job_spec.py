"""What every job manifest has, whatever runs it: ``[job]``, ``[checkpoint]``, the error.

Simulated jobs (:mod:`fedge.sim.job_manifest`) and fleet jobs
(:mod:`fedge.aggregator.fleet_manifest`) both read these tables the same way.
"""

import re
from dataclasses import dataclass

from fedge.errors import FedgeError

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ManifestError(FedgeError):
    """A job manifest is missing, malformed, or holds a bad value (the field is named)."""


@dataclass(frozen=True)
class JobSpec:
    """``[job]``: what the job is called, how long it trains, and its seed."""

    name: str
    rounds: int
    seed: int


@dataclass(frozen=True)
class CheckpointSpec:
    """``[checkpoint]``: how often the job checkpoints, and how many it keeps."""

    every: int = 1
    keep: int = 3

"""A synthetic job trace in the manner of FitGpp's evaluation (OpML'19, section 5).

FitGpp drew run times from normals with means 5 min (TE, cut at 30 min) and 30 min (BE,
cut at 24 h), resource demands from fitted truncated normals, grace periods from a normal
with a 3-minute mean cut at 20 min, and spaced Poisson arrivals so that FIFO's load is
2.0. The paper does not print every spread; ours are in :data:`TRACE` and the JSON. A
job's demand is in stations (one training slot each) of a fleet of ``stations``; the
arrival rate is set from the drawn trace itself so that the offered work
(sum of demand x run time) over the arrival span is exactly ``load`` x the fleet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fedge.edge_manager.scheduler.queue import Job, JobKind

MINUTE = 60.0


@dataclass(frozen=True)
class TruncNormal:
    mean: float  # of the normal before it is cut
    sd: float
    low: float
    high: float

    def draw(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.float64]:
        out = rng.normal(self.mean, self.sd, n)
        bad = (out < self.low) | (out > self.high)
        while bad.any():  # rejection: redraw only the values outside the cut
            out[bad] = rng.normal(self.mean, self.sd, int(bad.sum()))
            bad = (out < self.low) | (out > self.high)
        return out


@dataclass(frozen=True)
class TraceShape:
    stations: int = 64
    te_run_s: TruncNormal = TruncNormal(5 * MINUTE, 5 * MINUTE, 0.5 * MINUTE, 30 * MINUTE)
    be_run_s: TruncNormal = TruncNormal(30 * MINUTE, 60 * MINUTE, 1 * MINUTE, 24 * 60 * MINUTE)
    demand: TruncNormal = TruncNormal(2.0, 3.0, 1.0, 16.0)  # stations, rounded
    grace_s: TruncNormal = TruncNormal(3 * MINUTE, 3 * MINUTE, 10.0, 20 * MINUTE)

    def describe(self) -> dict[str, Any]:
        return asdict(self)


TRACE = TraceShape()


@dataclass(frozen=True)
class TraceJob:
    job: Job
    run_s: float  # the true run time; the scheduler sees only job.expected_run_s (LRTP)


def make_trace(
    jobs: int, te_share: float, load: float, seed: int, shape: TraceShape = TRACE
) -> list[TraceJob]:
    rng = np.random.default_rng(seed)
    is_te = rng.random(jobs) < te_share
    run_s = np.where(is_te, shape.te_run_s.draw(rng, jobs), shape.be_run_s.draw(rng, jobs))
    demand = np.rint(shape.demand.draw(rng, jobs)).astype(np.int64)
    grace_s = shape.grace_s.draw(rng, jobs)
    # Poisson arrivals at the rate that makes the offered load `load` x the fleet.
    rate = load * shape.stations / float(np.mean(demand * run_s))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, jobs))
    trace = []
    for i in range(jobs):
        kind = JobKind.TE if is_te[i] else JobKind.BE
        job = Job(
            job_id=f"j{i:07d}",
            kind=kind,
            team="bench",
            demand=int(demand[i]),
            submitted_at=float(arrivals[i]),
            grace_s=float(grace_s[i]),
            max_preemptions=1 << 30,  # no per-job cap: the policy's cap is what is measured
            expected_run_s=float(run_s[i]),  # LRTP is given the true run time (its best case)
        )
        trace.append(TraceJob(job, float(run_s[i])))
    return trace

"""Queue order and the choice of best-effort jobs to suspend: FitGpp, LRTP, RAND, FIFO.

FitGpp (Yabuuchi, Taniwaki, Omura, OpML'19, "Low-latency Job Scheduling with Preemption
for the Development of Deep Learning"): when a trial-and-error (TE) job cannot be placed,
suspend the running best-effort (BE) job ``j`` that minimises

    Score(j) = |D_j| / max_J |D_j| + s * GP_j / max_J GP_j

over the jobs ``J`` that may be preempted: ``D_TE <= D_j + N`` (its demand plus the free
capacity covers the TE job: "demand that fits") and ``PC_j < P`` (preemptions so far
under the cap). Small demand and short grace period win: those jobs free their room
soonest and cost least to resume. The paper uses ``s = 4`` and ``P = 1``; it needs no
estimate of run time. Here ``D_j`` is the number of stations ``j`` holds that the TE
job may use, and the cap is the smaller of the policy's and the job's own.

Our extension, for jobs that span stations (the paper's TE job always fits one node):
when no single job fits, suspend jobs in score order until enough *distinct* stations come
free. A job counts only the stations it frees that no job chosen before it frees: on a
station with several training slots, two victims there free two slots of one station,
and the TE job needs distinct stations (one slot on each).

Starvation guard (ours): a BE job that has already waited ``starvation_s`` in the queue
is not preempted again, whatever its score.

Baselines, as in the paper: LRTP suspends the job with the longest remaining time
(needs ``expected_run_s``), RAND a random fitting job, FIFO never preempts and keeps one
queue in arrival order. PRIORITY (ours, for the benchmark's breakdown) puts TE jobs first
but never preempts: it shows how much of the gain is the queue and how much preemption.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from fedge.edge_manager.scheduler.queue import JobKind, Queued, Running


class PolicyName(StrEnum):
    FIFO = "fifo"
    PRIORITY = "priority"
    FITGPP = "fitgpp"
    LRTP = "lrtp"
    RAND = "rand"


@dataclass(frozen=True)
class Policy:
    name: PolicyName = PolicyName.FITGPP
    cap: int | None = 1  # P: preemptions per job (None: only the job's own cap)
    grace_weight: float = 4.0  # s in FitGpp's score
    starvation_s: float | None = None
    seed: int = 0  # RAND's draws

    @property
    def te_first(self) -> bool:
        return self.name is not PolicyName.FIFO

    @property
    def preempts(self) -> bool:
        return self.name in (PolicyName.FITGPP, PolicyName.LRTP, PolicyName.RAND)


def queue_key(policy: Policy, queued: Queued) -> tuple[int, int, int, float, str]:
    """Sort key of the queue: TE before BE (unless FIFO), then suspended jobs at the head
    of their kind (FitGpp's promise to a preempted job: no priority overtakes it), then
    priority, then arrival."""
    job = queued.job
    kind_rank = 0 if (job.kind is JobKind.TE or not policy.te_first) else 1
    resumed_rank = 0 if queued.preemptions > 0 else 1
    return (kind_rank, resumed_rank, -job.priority, job.submitted_at, job.job_id)


def may_preempt(policy: Policy, running: Running, now: float) -> bool:
    """A running BE job under its preemption cap and not starved (see the module doc)."""
    if running.job.kind is not JobKind.BE or running.suspending:
        return False
    cap = running.job.max_preemptions
    if policy.cap is not None:
        cap = min(cap, policy.cap)
    if running.preemptions >= cap:
        return False
    return policy.starvation_s is None or running.waited_s < policy.starvation_s


def choose_victims(
    policy: Policy,
    te_job_id: str,
    candidates: Sequence[Running],
    needed: int,
    frees: Callable[[Running], frozenset[str]],
    now: float,
) -> tuple[Running, ...] | None:
    """The BE jobs to suspend so that ``needed`` more distinct stations come free, or None
    when even all candidates cannot free enough. ``frees(j)``: the stations ``j`` holds
    that the TE job may use (a slot there comes free when ``j`` stops)."""
    usable = [c for c in candidates if frees(c)]
    if len(frozenset().union(*(frees(c) for c in usable))) < needed:
        return None
    ranked = _ranked(policy, te_job_id, usable, frees, now)
    fitting = [c for c in ranked if len(frees(c)) >= needed]
    if fitting:
        return (fitting[0],)
    chosen: list[Running] = []
    freed: set[str] = set()
    for candidate in ranked:
        new = frees(candidate) - freed
        if not new:
            continue  # it frees only stations already coming free: no use suspending it
        chosen.append(candidate)
        freed |= new
        if len(freed) >= needed:
            return tuple(chosen)
    return None  # unreachable: the union covered it


def _ranked(
    policy: Policy,
    te_job_id: str,
    usable: list[Running],
    frees: Callable[[Running], frozenset[str]],
    now: float,
) -> list[Running]:
    """Candidates best first for the policy (ties broken by job id: deterministic)."""
    if policy.name is PolicyName.LRTP:
        return sorted(usable, key=lambda c: (-_remaining_s(c, now), c.job.job_id))
    if policy.name is PolicyName.RAND:
        ordered = sorted(usable, key=lambda c: c.job.job_id)
        random.Random(f"{policy.seed}:{te_job_id}:{now}").shuffle(ordered)
        return ordered
    max_demand = max(len(frees(c)) for c in usable)
    max_grace = max(c.job.grace_s for c in usable)

    def score(c: Running) -> float:
        return len(frees(c)) / max_demand + policy.grace_weight * c.job.grace_s / max_grace

    return sorted(usable, key=lambda c: (score(c), c.job.job_id))


def _remaining_s(running: Running, now: float) -> float:
    expected = running.job.expected_run_s
    if expected is None:
        return float("inf")  # unknown: assume long, LRTP's natural reading
    return expected - running.ran_s - (now - running.started_at)

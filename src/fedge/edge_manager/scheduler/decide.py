"""One scheduling decision: a snapshot of the fleet in, actions out.

The queue is walked in order (:func:`~.policy.queue_key`). A job whose stations can
take it now starts (or resumes, if it was suspended). A job that could not run now
whatever happened -- its team is over quota, or too few of its stations are inside
their training windows -- is passed over and does not hold up the queue. Any other job
that does not fit blocks the jobs behind it (FIFO, no backfilling), except a TE job
under a preempting policy: it claims stations already being freed, has BE jobs suspended
(:func:`~.policy.choose_victims`) for the rest, and keeps its claim while they finish
their round -- the jobs behind it may use what is left.

Nothing is remembered between calls: the claim is re-derived from the snapshot each time
(suspending jobs' stations are "incoming"), so an adapter may call :func:`decide` after
any event, or after a restart, and gets the same answer.
"""

from __future__ import annotations

from collections import Counter

from fedge.edge_manager.scheduler.policy import choose_victims, may_preempt
from fedge.edge_manager.scheduler.queue import (
    Actions,
    JobKind,
    Placement,
    Running,
    State,
    StationDrop,
    Suspension,
)
from fedge.edge_manager.scheduler.windows import may_train


def open_stations(state: State, now: float) -> dict[str, int]:
    """Stations that may train now (inside a window, with a slot at all), with their slots."""
    return {
        s.station_id: s.slots
        for s in state.stations
        if s.slots > 0
        and may_train(s.windows, now, utc_offset_s=s.utc_offset_s, idle_since=s.idle_since)
    }


def decide(state: State, now: float) -> Actions:
    policy = state.policy
    slots = open_stations(state, now)
    used: Counter[str] = Counter()
    incoming: Counter[str] = Counter()
    drops: list[StationDrop] = []
    for running in state.running:
        for station_id in running.stations:
            used[station_id] += 1
            if station_id not in slots:
                # Outside its window: the job finishes the round there, then drops it.
                drops.append(StationDrop(running.job.job_id, station_id))
            elif running.suspending:
                incoming[station_id] += 1
    free = {sid: n - used[sid] for sid, n in slots.items() if n - used[sid] > 0}
    candidates = [r for r in state.running if policy.preempts and may_preempt(policy, r, now)]
    starts: list[Placement] = []
    resumes: list[Placement] = []
    suspends: list[Suspension] = []

    for queued in state.queue:
        job = queued.job
        if state.team_remaining_s.get(job.team, 1.0) <= 0:
            continue
        if job.stations is None:
            eligible = sorted(slots)
        else:
            eligible = sorted(sid for sid in job.stations if sid in slots)
        if len(eligible) < job.demand:
            continue
        ready = [sid for sid in eligible if free.get(sid, 0) > 0]
        if len(ready) >= job.demand:
            chosen = tuple(ready[: job.demand])
            for sid in chosen:
                free[sid] -= 1
            placement = Placement(job.job_id, chosen)
            (resumes if queued.preemptions > 0 else starts).append(placement)
            continue
        if not (policy.preempts and job.kind is JobKind.TE):
            break
        claim = ready + [sid for sid in eligible if incoming[sid] > 0 and sid not in ready]
        if len(claim) < job.demand:
            claimed = set(claim)
            wanted = set(eligible) - claimed

            def frees(r: Running, wanted: set[str] = wanted) -> frozenset[str]:
                return frozenset(sid for sid in r.stations if sid in wanted)

            victims = choose_victims(
                policy, job.job_id, candidates, job.demand - len(claim), frees, now
            )
            if victims is None:
                break  # cannot be placed even by preemption: it waits, and so do those behind
            for victim in victims:
                suspends.append(Suspension(victim.job.job_id, job.job_id))
                candidates.remove(victim)
                for sid in victim.stations:
                    if sid in wanted:
                        incoming[sid] += 1
                        if sid not in claimed:
                            claimed.add(sid)
                            claim.append(sid)
        # Reserve: free stations first, then those coming free; the rest of the queue
        # may use what is left.
        for sid in claim[: job.demand]:
            if free.get(sid, 0) > 0:
                free[sid] -= 1
            else:
                incoming[sid] -= 1
    return Actions(tuple(starts), tuple(resumes), tuple(suspends), tuple(drops))

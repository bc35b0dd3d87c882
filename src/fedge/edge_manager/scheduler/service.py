"""The queue on the manager: submissions checked, the store read into a :class:`State`,
:func:`decide`'s actions recorded, and the round-boundary reports a runner makes.

The runner of admitted jobs (the fleet-job machinery) is the adapter that carries the
recorded actions out: it starts or resumes ``running`` jobs on their assigned stations,
asks ``suspending`` and ``cancelling`` jobs to stop after their current round, and calls
:func:`round_boundary` when one did. This module decides and records; it does no I/O
beyond the store.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler import team_store
from fedge.edge_manager.scheduler.decide import decide
from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.lifecycle import HOLDING, WAITING, JobState, cancel_target
from fedge.edge_manager.scheduler.policy import Policy, queue_key
from fedge.edge_manager.scheduler.queue import Actions, Queued, Running, State, Station
from fedge.edge_manager.scheduler.quota import used_station_seconds
from fedge.edge_manager.scheduler.store import JobRecord
from fedge.edge_manager.scheduler.submit import build_job
from fedge.edge_manager.scheduler.teams import (
    Membership,
    TeamRole,
    check_grant,
    check_known_team,
    check_may_administer,
    check_may_submit,
    check_revoke,
)
from fedge.edge_manager.scheduler.windows import parse_window
from fedge.edge_manager.store import Store

DAY_S = 86_400.0
SCHEDULER = "scheduler"  # the audit log's "who" for the scheduler's own decisions


def submit_job(
    store: Store,
    *,
    kind: str,
    team: str,
    stations: str,
    grace_s: float,
    max_preemptions: int,
    priority: int,
    job_dir: str,
    who: str,
    now: float,
    job_id: str | None = None,
    enrolled: Collection[str] | None = None,
) -> JobRecord:
    """Check and queue a job; a bad submission (or ``who`` may not submit for ``team``,
    teams.py) raises :class:`SchedulerError` and queues nothing. ``enrolled``: the
    stations it may name (default: the fleet's; a sweep's queue: its simulation slots)."""
    job = build_job(
        job_id=job_id or f"job-{uuid.uuid4().hex[:10]}",
        kind=kind,
        team=team,
        stations=stations,
        grace_s=grace_s,
        max_preemptions=max_preemptions,
        priority=priority,
        now=now,
        teams=queue_store.teams(store),
        enrolled=edge_store.names(store) if enrolled is None else enrolled,
    )
    check_may_submit(team, team_store.members(store, team), who)
    queue_store.submit(store, job, job_dir, who)
    return queue_store.job(store, job.job_id)


def fleet_stations(store: Store) -> list[Station]:
    """Every enrolled station with one training slot, and the training windows of its
    signed desired config (``training.windows``; none: any time). The idle window counts
    from the newest part the station reported scoring (never: idle since always)."""
    last_scored: dict[str, float] | None = None  # read only if some station has windows
    stations = []
    for name in edge_store.names(store):
        config = desired_store.latest_config(store, name)
        policy = None if config is None else config.training
        if policy is None or policy.windows is None:
            stations.append(Station(name))
            continue
        if last_scored is None:
            last_scored = queue_store.last_scored(store)
        stations.append(
            Station(
                name,
                windows=tuple(parse_window(w) for w in policy.windows),
                utc_offset_s=60 * (policy.utc_offset_minutes or 0),
                idle_since=last_scored.get(name, 0.0),
            )
        )
    return stations


def snapshot(store: Store, policy: Policy, stations: Sequence[Station], now: float) -> State:
    records = queue_store.jobs(store, states=(*WAITING, *HOLDING))
    queue = sorted(
        (
            Queued(r.job, r.queued_at, r.waited_s, r.ran_s, r.preemptions)
            for r in records
            if r.state in WAITING
        ),
        key=lambda q: queue_key(policy, q),
    )
    running = [
        Running(
            r.job,
            r.assigned,
            r.started_at if r.started_at is not None else now,
            r.waited_s,
            r.ran_s,
            r.preemptions,
            # A cancelling job also frees its stations at its round boundary.
            suspending=r.state is not JobState.RUNNING,
        )
        for r in records
        if r.state in HOLDING
    ]
    return State(policy, stations, queue, running, _remaining_quota(store, now))


def _remaining_quota(store: Store, now: float) -> dict[str, float]:
    """Station-seconds each team with a quota may still use: its quota less the station
    time its jobs held in the last 24 hours (:mod:`.quota`)."""
    quotas = {t: q for t, q in queue_store.teams(store).items() if q is not None}
    since = now - DAY_S
    used = used_station_seconds(queue_store.hold_events(store, quotas, since), since, now)
    return {team: quota * 3600.0 - used.get(team, 0.0) for team, quota in quotas.items()}


def tick(
    store: Store,
    policy: Policy,
    stations: Sequence[Station],
    now: float,
    *,
    pin_stations: bool = False,
) -> Actions:
    """One scheduling decision, recorded: started and resumed jobs become ``running`` on
    their stations (``pin_stations``: and may resume only there), the chosen BE jobs
    ``suspending``. Returns what the runner must do."""
    actions = decide(snapshot(store, policy, stations, now), now)
    for placement in (*actions.start, *actions.resume):
        queue_store.transition(
            store,
            placement.job_id,
            JobState.RUNNING,
            who=SCHEDULER,
            at=now,
            detail="on " + ",".join(placement.stations),
            assigned=placement.stations,
            pin_stations=pin_stations,
        )
    for suspension in actions.suspend:
        # The audit log names whose job took the stations, not only which job.
        urgent = queue_store.job(store, suspension.for_job)
        queue_store.transition(
            store,
            suspension.job_id,
            JobState.SUSPENDING,
            who=SCHEDULER,
            at=now,
            detail=f"preempted for {suspension.for_job} (team {urgent.job.team}, submitted by "
            f"{urgent.submitted_by}; FitGpp)",
        )
    _stop_for_windows(store, actions, now)
    return actions


def _stop_for_windows(store: Store, actions: Actions, now: float) -> None:
    """A running job with a station outside its window finishes the round there, then
    stops (suspended, its checkpoint kept); it resumes on its stations once every one of
    them may train again. A fleet job cannot drop one party mid-job (its party map and
    checkpoint are its stations'), so the whole job waits; the suspension counts as one
    of its preemptions."""
    left: dict[str, list[str]] = {}
    for drop in actions.drop:
        left.setdefault(drop.job_id, []).append(drop.station_id)
    for job_id, stations in sorted(left.items()):
        if queue_store.job(store, job_id).state is not JobState.RUNNING:
            continue
        queue_store.transition(
            store,
            job_id,
            JobState.SUSPENDING,
            who=SCHEDULER,
            at=now,
            detail=f"{', '.join(sorted(stations))} left its training window: stops after its round",
        )


def cancel(store: Store, job_id: str, *, who: str, now: float) -> JobRecord:
    """Cancel: a waiting job now, a running one at its next round boundary (by a submitter
    or admin of the job's team, teams.py)."""
    record = queue_store.job(store, job_id)
    check_may_submit(record.job.team, team_store.members(store, record.job.team), who)
    return queue_store.transition(
        store, job_id, cancel_target(record.state), who=who, at=now, detail="cancelled"
    )


def set_priority(store: Store, job_id: str, priority: int, *, who: str, now: float) -> JobRecord:
    """Change a waiting job's priority (by a submitter or admin of its team)."""
    team = queue_store.job(store, job_id).job.team
    check_may_submit(team, team_store.members(store, team), who)
    return queue_store.set_priority(store, job_id, priority, who=who, at=now)


def add_team(store: Store, team: str, quota: float | None, *, who: str, now: float) -> None:
    """Add a team, or change its quota (an existing team's: by its admin)."""
    if team in queue_store.teams(store):
        check_may_administer(team, team_store.members(store, team), who)
    queue_store.add_team(store, team, quota, now)


def grant(
    store: Store,
    team: str,
    member: str,
    role: TeamRole,
    *,
    who: str,
    now: float,
    known: frozenset[str] | None = None,
    fleet_admin: bool = False,
) -> None:
    """Give ``member`` ``role`` in ``team`` (``known``: the people the manager knows --
    operator and console accounts; None: not checked; ``fleet_admin``: ``who`` is a
    console admin, who administers every team)."""
    check_known_team(team, queue_store.teams(store))
    if known is not None and member not in known:
        raise SchedulerError(
            f"no operator or console account {member!r}; add one with "
            f"`fedge manager operator add {member}` or `fedge console token add {member}`"
        )
    members = team_store.members(store, team)
    if not fleet_admin:
        check_may_administer(team, members, who)
    check_grant(team, members, member, role)
    team_store.grant(store, Membership(team, member, role, now, who))


def revoke(store: Store, team: str, member: str, *, who: str, fleet_admin: bool = False) -> None:
    check_known_team(team, queue_store.teams(store))
    members = team_store.members(store, team)
    if not fleet_admin:
        check_may_administer(team, members, who)
    check_revoke(team, members, member)
    team_store.revoke(store, team, member)


def round_boundary(store: Store, job_id: str, *, now: float, detail: str = "") -> JobRecord:
    """The runner reports that a job asked to stop has finished its round (and, when
    suspending, written its checkpoint): it frees its stations."""
    state = queue_store.job(store, job_id).state
    if state is JobState.SUSPENDING:
        new = JobState.SUSPENDED
    elif state is JobState.CANCELLING:
        new = JobState.CANCELLED
    else:
        raise SchedulerError(f"job {job_id} is {state.value}; it was not asked to stop")
    return queue_store.transition(store, job_id, new, who=SCHEDULER, at=now, detail=detail)

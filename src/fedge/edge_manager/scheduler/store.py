"""The job queue in the manager's store: ``teams``, ``queue_jobs``, ``queue_events``.

Every state change is one transaction that updates the job's row and appends its event
(who, when, why), so a manager killed at any point finds the queue as it last stood:
a suspended job keeps its place (``preemptions``, ``queued_at``) and nothing that
was started is started twice (the row says ``running`` and on which stations). The
scheduler (decide.py) and the CLI call these functions; no row leaves this module.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.lifecycle import JobState, check_transition
from fedge.edge_manager.scheduler.queue import Job, JobKind
from fedge.edge_manager.scheduler.quota import HoldEvent
from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class JobRecord:
    job: Job
    job_dir: str
    submitted_by: str
    state: JobState
    preemptions: int
    queued_at: float
    waited_s: float
    ran_s: float
    started_at: float | None
    assigned: tuple[str, ...]
    updated_at: float


@dataclass(frozen=True)
class JobEvent:
    at: float
    state: str
    who: str
    detail: str


def add_team(store: Store, team: str, quota_station_hours: float | None, at: float) -> None:
    if not team.strip():
        raise SchedulerError("a team needs a name")
    if quota_station_hours is not None and quota_station_hours < 0:
        raise SchedulerError(f"team {team}: the quota must be >= 0 station-hours a day")
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO teams (team, quota_station_hours, created_at) VALUES (?, ?, ?) "
            "ON CONFLICT (team) DO UPDATE SET quota_station_hours = excluded.quota_station_hours",
            (team, quota_station_hours, at),
        )


def teams(store: Store) -> dict[str, float | None]:
    return {
        r["team"]: r["quota_station_hours"]
        for r in store.query("SELECT team, quota_station_hours FROM teams ORDER BY team")
    }


def hold_events(store: Store, teams: Collection[str], since: float) -> list[HoldEvent]:
    """The state changes of ``teams``' jobs that may have held stations since ``since``
    (a job that ended before then cannot have), each job's in time order."""
    if not teams:
        return []
    marks = ", ".join("?" for _ in teams)
    rows = store.query(
        "SELECT e.job_id, j.team, j.demand, e.at, e.state FROM queue_events e "
        "JOIN queue_jobs j ON j.job_id = e.job_id "
        f"WHERE j.team IN ({marks}) AND (j.updated_at >= ? OR j.state IN ('running', "
        "'suspending', 'cancelling')) ORDER BY e.job_id, e.at, e.rowid",
        (*teams, since),
    )
    return [HoldEvent(r["job_id"], r["team"], r["demand"], r["at"], r["state"]) for r in rows]


def last_scored(store: Store) -> dict[str, float]:
    """When each station last reported scoring a part (its line's last activity)."""
    return {
        r["edge"]: r["at"]
        for r in store.query("SELECT edge, max(at) AS at FROM predictions GROUP BY edge")
    }


def submit(store: Store, job: Job, job_dir: str, who: str) -> None:
    stations = "" if job.stations is None else json.dumps(sorted(job.stations))
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO queue_jobs (job_id, kind, team, demand, stations, grace_s, "
            "max_preemptions, priority, job_dir, submitted_at, submitted_by, state, queued_at, "
            "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job.job_id,
                job.kind.value,
                job.team,
                job.demand,
                stations,
                job.grace_s,
                job.max_preemptions,
                job.priority,
                job_dir,
                job.submitted_at,
                who,
                JobState.QUEUED.value,
                job.submitted_at,
                job.submitted_at,
            ),
        )
        _event(conn, job.job_id, job.submitted_at, JobState.QUEUED.value, who, "submitted")


def transition(
    store: Store,
    job_id: str,
    new: JobState,
    *,
    who: str,
    at: float,
    detail: str = "",
    assigned: tuple[str, ...] | None = None,
    pin_stations: bool = False,
) -> JobRecord:
    """Move a job to ``new`` (checked against the lifecycle), with its bookkeeping: time
    waited and run, preemptions, the stations it holds; and its event. ``pin_stations``:
    a job started on ``assigned`` may resume only there (a fleet job's checkpoint and
    party map belong to its stations)."""
    with store.transaction() as conn:
        row = _row(conn, job_id)
        current = JobState(row["state"])
        check_transition(job_id, current, new)
        updates: dict[str, Any] = {"state": new.value, "updated_at": at}
        if new is JobState.RUNNING:
            updates["waited_s"] = row["waited_s"] + at - row["queued_at"]
            updates["started_at"] = at
            updates["assigned"] = json.dumps(list(assigned or ()))
            if pin_stations and assigned:
                updates["stations"] = json.dumps(sorted(assigned))
        if new is JobState.SUSPENDING:
            updates["ran_s"] = row["ran_s"] + at - (row["started_at"] or at)
        if new is JobState.SUSPENDED:
            updates["preemptions"] = row["preemptions"] + 1
            updates["queued_at"] = at
            updates["assigned"] = ""
        columns = ", ".join(f"{name} = ?" for name in updates)
        conn.execute(
            f"UPDATE queue_jobs SET {columns} WHERE job_id = ?", (*updates.values(), job_id)
        )
        _event(conn, job_id, at, new.value, who, detail)
        return _record(_row(conn, job_id))


def set_priority(store: Store, job_id: str, priority: int, *, who: str, at: float) -> JobRecord:
    with store.transaction() as conn:
        row = _row(conn, job_id)
        if JobState(row["state"]) not in (JobState.QUEUED, JobState.SUSPENDED):
            raise SchedulerError(
                f"job {job_id} is {row['state']}; only a waiting job's priority can change"
            )
        conn.execute(
            "UPDATE queue_jobs SET priority = ?, updated_at = ? WHERE job_id = ?",
            (priority, at, job_id),
        )
        _event(conn, job_id, at, row["state"], who, f"priority {row['priority']} -> {priority}")
        return _record(_row(conn, job_id))


def job(store: Store, job_id: str) -> JobRecord:
    row = store.one("SELECT * FROM queue_jobs WHERE job_id = ?", (job_id,))
    if row is None:
        raise SchedulerError(f"no job {job_id}; see fedge jobs list")
    return _record(row)


def jobs(store: Store, *, states: tuple[JobState, ...] = ()) -> list[JobRecord]:
    if states:
        marks = ", ".join("?" for _ in states)
        rows = store.query(
            f"SELECT * FROM queue_jobs WHERE state IN ({marks}) ORDER BY submitted_at, job_id",
            tuple(s.value for s in states),
        )
    else:
        rows = store.query("SELECT * FROM queue_jobs ORDER BY submitted_at, job_id")
    return [_record(r) for r in rows]


def events(store: Store, job_id: str) -> list[JobEvent]:
    return [
        JobEvent(r["at"], r["state"], r["who"], r["detail"])
        for r in store.query(
            "SELECT at, state, who, detail FROM queue_events WHERE job_id = ? ORDER BY at, rowid",
            (job_id,),
        )
    ]


def _event(
    conn: sqlite3.Connection, job_id: str, at: float, state: str, who: str, detail: str
) -> None:
    conn.execute(
        "INSERT INTO queue_events (job_id, at, state, who, detail) VALUES (?, ?, ?, ?, ?)",
        (job_id, at, state, who, detail),
    )


def _row(conn: sqlite3.Connection, job_id: str) -> dict[str, Any]:
    cursor = conn.execute("SELECT * FROM queue_jobs WHERE job_id = ?", (job_id,))
    values = cursor.fetchone()
    if values is None:
        raise SchedulerError(f"no job {job_id}; see fedge jobs list")
    return dict(zip([d[0] for d in cursor.description], values, strict=True))


def _record(row: dict[str, Any]) -> JobRecord:
    stations = frozenset(json.loads(row["stations"])) if row["stations"] else None
    return JobRecord(
        job=Job(
            row["job_id"],
            JobKind(row["kind"]),
            row["team"],
            row["demand"],
            submitted_at=row["submitted_at"],
            grace_s=row["grace_s"],
            stations=stations,
            max_preemptions=row["max_preemptions"],
            priority=row["priority"],
        ),
        job_dir=row["job_dir"],
        submitted_by=row["submitted_by"],
        state=JobState(row["state"]),
        preemptions=row["preemptions"],
        queued_at=row["queued_at"],
        waited_s=row["waited_s"],
        ran_s=row["ran_s"],
        started_at=row["started_at"],
        assigned=tuple(json.loads(row["assigned"])) if row["assigned"] else (),
        updated_at=row["updated_at"],
    )

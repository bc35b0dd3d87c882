"""Team memberships in the manager's store (``team_members``, migration 10), and which
team queued the job in a job directory (the console's view of a team's jobs).

No row leaves this module; teams.py decides what a role allows.
"""

from __future__ import annotations

from collections.abc import Collection

from fedge.edge_manager.scheduler.teams import Membership, TeamRole
from fedge.edge_manager.store import Store


def grant(store: Store, membership: Membership) -> None:
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO team_members (team, member, role, granted_at, granted_by) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (team, member) DO UPDATE SET "
            "role = excluded.role, granted_at = excluded.granted_at, "
            "granted_by = excluded.granted_by",
            (
                membership.team,
                membership.member,
                membership.role.value,
                membership.granted_at,
                membership.granted_by,
            ),
        )


def revoke(store: Store, team: str, member: str) -> bool:
    with store.transaction() as conn:
        cursor = conn.execute(
            "DELETE FROM team_members WHERE team = ? AND member = ?", (team, member)
        )
        return cursor.rowcount > 0


def members(store: Store, team: str) -> dict[str, TeamRole]:
    return {
        r["member"]: TeamRole(r["role"])
        for r in store.query(
            "SELECT member, role FROM team_members WHERE team = ? ORDER BY member", (team,)
        )
    }


def memberships(store: Store) -> list[Membership]:
    return [
        Membership(r["team"], r["member"], TeamRole(r["role"]), r["granted_at"], r["granted_by"])
        for r in store.query(
            "SELECT team, member, role, granted_at, granted_by FROM team_members "
            "ORDER BY team, member"
        )
    ]


def teams_of_job_dirs(store: Store, job_dirs: Collection[str]) -> dict[str, str]:
    """job directory -> the team that queued a job to run there (absent: run by hand)."""
    if not job_dirs:
        return {}
    marks = ", ".join("?" for _ in job_dirs)
    return {
        r["job_dir"]: r["team"]
        for r in store.query(
            f"SELECT job_dir, team FROM queue_jobs WHERE job_dir IN ({marks}) "
            "ORDER BY submitted_at",
            tuple(job_dirs),
        )
    }

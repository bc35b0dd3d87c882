"""Teams and their roles (issue 31 item 4): who may queue, change and see a team's jobs.

A team owns its jobs (and, on the console, their view). Each member holds one role in it:

- ``viewer`` sees the team's jobs;
- ``submitter`` also queues jobs for the team, cancels them and changes their priority;
- ``admin`` also grants and revokes roles in the team and sets its quota.

Members are named as the manager knows people: operator accounts (``fedge manager
operator add``) and console accounts (``fedge console token add``); the CLI's ``--as``
names one of them. A team that has no member yet is open, as every team was before roles
existed, so a fleet that never grants a role works as before; its first grant must name an
admin and closes it. The scheduler's own decisions (start, preempt, resume) act for every
team. These are pure checks over frozen values; team_store.py keeps the memberships.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum

from fedge.edge_manager.scheduler.errors import SchedulerError


class TeamRole(StrEnum):
    VIEWER = "viewer"
    SUBMITTER = "submitter"
    ADMIN = "admin"

    @property
    def can_submit(self) -> bool:
        return self is not TeamRole.VIEWER


@dataclass(frozen=True)
class Membership:
    team: str
    member: str
    role: TeamRole
    granted_at: float
    granted_by: str


def parse_role(value: str) -> TeamRole:
    try:
        return TeamRole(value)
    except ValueError:
        choices = ", ".join(role.value for role in TeamRole)
        raise SchedulerError(f"team role must be one of {choices}, not {value!r}") from None


def check_known_team(team: str, teams: Collection[str]) -> None:
    if team not in teams:
        known = ", ".join(sorted(teams)) or "none yet"
        raise SchedulerError(
            f"unknown team {team!r} (teams: {known}); add it with: fedge team add {team}"
        )


def check_may_submit(team: str, members: Mapping[str, TeamRole], who: str) -> None:
    """``who`` may queue, cancel or re-prioritise ``team``'s jobs (``members``: the team's
    roles; none: the team is open)."""
    if not members:
        return
    role = members.get(who)
    if role is None:
        raise SchedulerError(
            f"{who} is not a member of team {team}; a team admin can grant a role with: "
            f"fedge team grant {team} {who} --role submitter"
        )
    if not role.can_submit:
        raise SchedulerError(
            f"{who} is a viewer of team {team}; only its submitters and admins change its "
            f"jobs (ask a team admin: fedge team grant {team} {who} --role submitter)"
        )


def check_may_administer(team: str, members: Mapping[str, TeamRole], who: str) -> None:
    """``who`` may grant and revoke roles in ``team`` and set its quota (an open team: anyone
    with the manager's home, who must then name an admin first)."""
    if members and members.get(who) is not TeamRole.ADMIN:
        admins = ", ".join(sorted(m for m, r in members.items() if r is TeamRole.ADMIN))
        raise SchedulerError(f"only an admin of team {team} ({admins}) can change its roles")


def check_grant(team: str, members: Mapping[str, TeamRole], member: str, role: TeamRole) -> None:
    """A grant leaves the team with an admin: an open team's first member is its admin."""
    if not members and role is not TeamRole.ADMIN:
        raise SchedulerError(
            f"team {team} has no member yet; grant an admin first: "
            f"fedge team grant {team} {member} --role admin"
        )
    others = {m: r for m, r in members.items() if m != member}
    # Also when the member is the only one: an admin demoting themselves would leave a
    # closed team nobody can manage (revoking the last member opens it instead).
    if role is not TeamRole.ADMIN and TeamRole.ADMIN not in others.values():
        raise SchedulerError(f"team {team} would be left without an admin; grant another first")


def check_revoke(team: str, members: Mapping[str, TeamRole], member: str) -> None:
    if member not in members:
        raise SchedulerError(f"{member} holds no role in team {team}; see: fedge team list")
    others = {m: r for m, r in members.items() if m != member}
    if others and TeamRole.ADMIN not in others.values():
        raise SchedulerError(
            f"revoking {member} would leave team {team} without an admin; grant another first"
        )


def visible_teams(memberships: Collection[Membership], who: str) -> frozenset[str]:
    """The teams whose jobs ``who`` sees (any role)."""
    return frozenset(m.team for m in memberships if m.member == who)


def may_see(team: str | None, members: Mapping[str, TeamRole], who: str, *, admin: bool) -> bool:
    """``who`` sees what ``team`` owns (a model, a job): a team-less thing and an open
    team's are everyone's; a closed team's are its members' and the console's admins'."""
    return team is None or not members or admin or who in members


def check_may_deploy(ref: str, team: str, members: Mapping[str, TeamRole], who: str) -> None:
    """``who`` may deploy or roll out ``ref``, a model ``team`` owns: as for its jobs, a
    submitter or admin of the team (an open team: anyone)."""
    if not members or ((role := members.get(who)) is not None and role.can_submit):
        return
    held = "no role" if who not in members else "only a viewer's role"
    raise SchedulerError(
        f"{ref} belongs to team {team} and {who} holds {held} in it; only its submitters "
        f"and admins deploy it (ask a team admin: fedge team grant {team} {who} "
        "--role submitter); nothing was deployed"
    )

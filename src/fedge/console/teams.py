"""The console's teams page (issue 31 item 4): each team, its members with their roles,
and its quota beside the station-hours its jobs held in the last 24 hours; grant and
revoke a role from it.

The console's admins see and change every team; any other account sees and changes the
teams it is an admin of (teams.py's rule, as ``fedge team grant --as``), and is refused
the page when it administers none. Every grant and revoke goes through
``scheduler.service`` (a team always keeps an admin; the member must be an operator or
console account) and is in the console's audit log (app.py's ``act``).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from fedge.console import accounts
from fedge.console.accounts import Account, Role
from fedge.console.errors import BadInput
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.scheduler import owned_models, service, team_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.teams import Membership, TeamRole, parse_role

ROLES = tuple(role.value for role in TeamRole)
MAX_NAME = 128


@dataclass(frozen=True)
class TeamView:
    team: str
    quota_station_hours: float | None
    used_station_hours: float  # held by its jobs in the last 24 hours
    members: tuple[Membership, ...]

    @property
    def over_quota(self) -> bool:
        quota = self.quota_station_hours
        return quota is not None and self.used_station_hours >= quota


def administered(fleet: Fleet, viewer: Account) -> frozenset[str]:
    """The teams ``viewer`` may read and change on this page."""
    if viewer.role is Role.ADMIN:
        return frozenset(queue_store.teams(fleet.store))
    return frozenset(
        m.team
        for m in team_store.memberships(fleet.store)
        if m.member == viewer.name and m.role is TeamRole.ADMIN
    )


def teams_page(fleet: Fleet, viewer: Account, now: float | None = None) -> list[TeamView]:
    shown = administered(fleet, viewer)
    quotas = queue_store.teams(fleet.store)
    used = owned_models.used_station_hours(fleet.store, time.time() if now is None else now)
    memberships = team_store.memberships(fleet.store)
    return [
        TeamView(
            team,
            quota,
            used.get(team, 0.0),
            tuple(m for m in memberships if m.team == team),
        )
        for team, quota in quotas.items()
        if team in shown
    ]


def _member(form: dict[str, str]) -> str:
    member = form.get("member", "").strip()
    if not member or len(member) > MAX_NAME:
        raise BadInput("name the member: an operator or console account")
    return member


def _check_team(fleet: Fleet, team: str, viewer: Account) -> None:
    if team not in administered(fleet, viewer):
        # The same refusal for a team that does not exist and one the viewer does not
        # administer: the page does not tell which teams exist.
        raise BadInput(f"{viewer.name} administers no team {team!r}; see the teams page")


def grant(
    fleet: Fleet, viewer: Account, team: str, form: dict[str, str], operators: Collection[str]
) -> str:
    """Give the form's member the form's role in ``team`` (``operators``: the manager's
    operator accounts, who may be members as well as console accounts)."""
    _check_team(fleet, team, viewer)
    member, role = _member(form), parse_role(form.get("role", ""))
    known = frozenset(operators) | {a.name for a in accounts.list_accounts(fleet.store)}
    service.grant(
        fleet.store,
        team,
        member,
        role,
        who=viewer.name,
        now=time.time(),
        known=known,
        fleet_admin=viewer.role is Role.ADMIN,
    )
    return f"{member}: {role.value} of team {team}"


def revoke(fleet: Fleet, viewer: Account, team: str, form: dict[str, str]) -> str:
    _check_team(fleet, team, viewer)
    member = _member(form)
    service.revoke(
        fleet.store, team, member, who=viewer.name, fleet_admin=viewer.role is Role.ADMIN
    )
    return f"{member}: no role in team {team}"

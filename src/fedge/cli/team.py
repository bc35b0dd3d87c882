"""``fedge team``: teams and their roles (issue 31 item 4), wired onto
fedge.edge_manager.scheduler (teams.py says what each role allows)."""

import time
from pathlib import Path
from typing import Annotated

import typer

from fedge.cli import jobs as jobs_cli
from fedge.cli.common import DEFAULT_HOME, HomeOption, console, fitted_table, print_json, when
from fedge.cli.common import friendly_errors as _friendly
from fedge.cli.jobs import JsonOption, WhoOption, _store, _who
from fedge.console import accounts
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.scheduler import service, team_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.teams import check_known_team, parse_role
from fedge.edge_manager.store import Store

app = typer.Typer(
    help="Teams own their jobs: roles viewer, submitter, admin. "
    "Example: fedge team grant vision ana --role submitter",
    no_args_is_help=True,
)


def _known(home: Path, store: Store) -> frozenset[str]:
    """The people the manager knows: its operator accounts and console accounts."""
    operators = ManagerHome(home).operator_accounts()
    return frozenset(operators) | {a.name for a in accounts.list_accounts(store)}


# `fedge team add` is `fedge jobs team`: one command under both names.
app.command("add")(jobs_cli.team)


@app.command("list")
@_friendly
def list_teams(as_json: JsonOption = False, home: HomeOption = DEFAULT_HOME) -> None:
    """Every team, its quota and its members' roles.

    Example: fedge team list
    """
    with _store(home) as store:
        quotas = queue_store.teams(store)
        members = team_store.memberships(store)
    rows = [
        {
            "team": team,
            "quota_station_hours": quota,
            "members": {m.member: m.role.value for m in members if m.team == team},
        }
        for team, quota in quotas.items()
    ]
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print("no teams")
        return
    table = fitted_table("team", "quota", "members")
    for row in rows:
        quota = row["quota_station_hours"]
        named = row["members"]
        assert isinstance(named, dict)
        table.add_row(
            str(row["team"]),
            "none" if quota is None else f"{quota:g} station-h/day",
            ", ".join(f"{m} ({r})" for m, r in named.items()) or "open (no member yet)",
        )
    console.print(table)


@app.command()
@_friendly
def grant(
    team: Annotated[str, typer.Argument(help="The team.")],
    member: Annotated[str, typer.Argument(help="An operator or console account.")],
    role: Annotated[str, typer.Option(help="viewer, submitter or admin.")] = "submitter",
    who: WhoOption = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Give a member a role in a team (a team's first member must be its admin).

    Example: fedge team grant vision ana --role admin --as ana
    """
    parsed = parse_role(role)
    with _store(home) as store:
        service.grant(
            store, team, member, parsed, who=_who(who), now=time.time(), known=_known(home, store)
        )
    console.print(f"{member}: {parsed.value} of team {team}", highlight=False)


@app.command()
@_friendly
def revoke(
    team: Annotated[str, typer.Argument(help="The team.")],
    member: Annotated[str, typer.Argument(help="The member.")],
    who: WhoOption = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Take a member's role in a team away (the team keeps an admin).

    Example: fedge team revoke vision bo --as ana
    """
    with _store(home) as store:
        service.revoke(store, team, member, who=_who(who))
    console.print(f"{member}: no role in team {team}", highlight=False)


@app.command()
@_friendly
def members(
    team: Annotated[str, typer.Argument(help="The team.")],
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """A team's members, their roles, who granted them and when.

    Example: fedge team members vision
    """
    with _store(home) as store:
        check_known_team(team, queue_store.teams(store))
        rows = [m for m in team_store.memberships(store) if m.team == team]
    table = fitted_table("member", "role", "granted by", "at")
    for m in rows:
        table.add_row(m.member, m.role.value, m.granted_by, when(m.granted_at))
    console.print(table if rows else f"team {team}: no member (open to everyone)")

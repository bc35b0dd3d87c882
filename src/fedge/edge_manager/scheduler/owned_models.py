"""A team owns its models (issue 31 item 4): the version a team's queued job published, or
one published with ``fedge model publish --team``, is the team's; its members (and the
console's admins) see it, its submitters and admins deploy it. A version no team owns is
everyone's, as before teams. The checks are teams.py's; the rows model_team_store.py's.
"""

from __future__ import annotations

from pathlib import Path

from fedge.edge_manager.scheduler import model_team_store, team_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.quota import used_station_seconds
from fedge.edge_manager.scheduler.teams import (
    check_known_team,
    check_may_deploy,
    check_may_submit,
    may_see,
)
from fedge.edge_manager.store import Store

DAY_S = 86_400.0


def own(store: Store, name: str, version: int, team: str, *, who: str, now: float) -> None:
    """Record that ``team`` owns ``name:version`` (``who``: a submitter or admin of it)."""
    check_known_team(team, queue_store.teams(store))
    check_may_submit(team, team_store.members(store, team), who)
    model_team_store.record(store, name, version, team, who=who, at=now)


def check_known(store: Store, team: str) -> None:
    check_known_team(team, queue_store.teams(store))


def check_team(store: Store, team: str, who: str) -> None:
    """Before publishing for ``team``: it exists and ``who`` may publish for it."""
    check_known_team(team, queue_store.teams(store))
    check_may_submit(team, team_store.members(store, team), who)


def own_published(store: Store, job_dir: Path, name: str, version: int, now: float) -> str | None:
    """The team that queued the job in ``job_dir`` owns the version it published (None:
    the job was run by hand, the version is no team's)."""
    # The queue stores a job's directory resolved (federation/link_jobs.py).
    named = {str(job_dir), str(job_dir.resolve())}
    found = team_store.teams_of_job_dirs(store, named)
    team = next((found[d] for d in sorted(named) if d in found), None)
    if team is not None:
        model_team_store.record(store, name, version, team, who="scheduler", at=now)
    return team


def check_deploy(store: Store, name: str, version: int, who: str | None) -> None:
    """``who`` (``--as``; None: not checked, as before teams) may deploy ``name:version``."""
    team = model_team_store.owner(store, name, version)
    if who is None or team is None:
        return
    check_may_deploy(f"{name}:{version}", team, team_store.members(store, team), who)


def hidden(store: Store, who: str, *, admin: bool) -> frozenset[tuple[str, int]]:
    """The versions ``who`` may not see: another closed team's (``admin``: the console's
    admins see every one)."""
    owners = model_team_store.owners(store)
    members = {team: team_store.members(store, team) for team in set(owners.values())}
    return frozenset(
        key for key, team in owners.items() if not may_see(team, members[team], who, admin=admin)
    )


def owners(store: Store) -> dict[tuple[str, int], str]:
    return model_team_store.owners(store)


def used_station_hours(store: Store, now: float) -> dict[str, float]:
    """Station-hours each team's jobs held in the last 24 hours (:mod:`.quota`)."""
    teams = queue_store.teams(store)
    since = now - DAY_S
    used = used_station_seconds(queue_store.hold_events(store, teams, since), since, now)
    return {team: used.get(team, 0.0) / 3600.0 for team in teams}

"""The console's teams page (issue 31 item 4): the console's admins and each team's
admins read the teams they administer -- members, roles, the quota and the station-hours
used in the last 24 hours -- and grant or revoke roles (CSRF, audited); anyone else is
refused."""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, console_login, make_fleet_home

from fedge.console import audit
from fedge.console.audit import Outcome
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.scheduler import service, team_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.lifecycle import JobState
from fedge.edge_manager.scheduler.teams import TeamRole


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=("st-01", "st-02"))
    yield fleet_home
    fleet_home.close()


def setup_teams(fh: FleetHome, now: float) -> None:
    """vision (ana admin, quota 2 station-h, one job holding a station for the last 3 h),
    paint (pia admin, no quota)."""
    with fh.fleet() as fleet:
        store = fleet.store
        if not edge_store.names(store):
            edge_store.enroll(store, "st-01", "0" * 64, 0.0)
        service.add_team(store, "vision", 2.0, who="root", now=0.0)
        service.add_team(store, "paint", None, who="root", now=0.0)
        service.grant(store, "vision", "ana", TeamRole.ADMIN, who="root", now=0.0)
        service.grant(store, "paint", "pia", TeamRole.ADMIN, who="root", now=0.0)
        job = service.submit_job(
            store, kind="be", team="vision", stations="any 1", grace_s=60.0,
            max_preemptions=1, priority=0, job_dir="", who="ana", now=now - 3 * 3600,
        )  # fmt: skip
        queue_store.transition(
            store, job.job.job_id, JobState.RUNNING, who="scheduler", at=now - 3 * 3600
        )


def test_admins_read_their_teams_and_others_are_refused(fh: FleetHome) -> None:
    setup_teams(fh, time.time())
    ana, _ = console_login(fh, "operator", "ana")
    page = ana.get("/teams")
    assert page.status_code == 200
    assert 'data-team="vision"' in page.text and 'data-team="paint"' not in page.text
    assert 'class="bad">3.00</td>' in page.text  # 3 station-h used of a quota of 2
    boss, _ = console_login(fh, "admin", "boss")
    every = boss.get("/teams").text
    assert 'data-team="vision"' in every and 'data-team="paint"' in every
    cy, _ = console_login(fh, "operator", "cy")
    refused = cy.get("/teams")
    assert refused.status_code == 403 and "team&#39;s admin" in refused.text


def test_grant_and_revoke_from_the_console_are_checked_and_audited(fh: FleetHome) -> None:
    setup_teams(fh, 10.0)
    console_login(fh, "viewer", "bo")  # an account the manager knows
    ana, csrf = console_login(fh, "operator", "ana")
    forged = ana.post("/teams/vision/grant", data={"csrf": "x", "member": "bo", "role": "admin"})
    assert forged.status_code == 403
    done = ana.post("/teams/vision/grant", data={"csrf": csrf, "member": "bo", "role": "submitter"})
    assert done.status_code == 303 and done.headers["location"] == "/teams"
    other = ana.post("/teams/paint/grant", data={"csrf": csrf, "member": "bo", "role": "viewer"})
    assert other.status_code == 400 and "ana administers no team" in other.text
    unknown = ana.post(
        "/teams/vision/grant", data={"csrf": csrf, "member": "zed", "role": "viewer"}
    )
    assert unknown.status_code == 400 and "no operator or console account" in unknown.text
    boss, boss_csrf = console_login(fh, "admin", "boss")  # the console's admin: every team
    assert (
        boss.post(
            "/teams/paint/grant", data={"csrf": boss_csrf, "member": "bo", "role": "viewer"}
        ).status_code
        == 303
    )
    last = ana.post("/teams/vision/revoke", data={"csrf": csrf, "member": "ana"})
    assert last.status_code == 400 and "without an admin" in last.text
    assert ana.post("/teams/vision/revoke", data={"csrf": csrf, "member": "bo"}).status_code == 303
    with fh.fleet() as fleet:
        assert team_store.members(fleet.store, "vision") == {"ana": TeamRole.ADMIN}
        assert team_store.members(fleet.store, "paint") == {
            "bo": TeamRole.VIEWER, "pia": TeamRole.ADMIN,
        }  # fmt: skip
        logged = [
            (e.who, e.action, e.target, e.outcome)
            for e in reversed(audit.recent(fleet.store))
            if e.action.startswith("team-")
        ]
    assert logged == [
        ("ana", "team-grant", "vision", Outcome.REFUSED),  # CSRF
        ("ana", "team-grant", "vision", Outcome.DONE),
        ("ana", "team-grant", "paint", Outcome.INVALID),
        ("ana", "team-grant", "vision", Outcome.INVALID),
        ("boss", "team-grant", "paint", Outcome.DONE),
        ("ana", "team-revoke", "vision", Outcome.INVALID),
        ("ana", "team-revoke", "vision", Outcome.DONE),
    ]

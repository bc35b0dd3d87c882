"""Teams and roles (issue 31 item 4): who may queue, cancel and re-prioritise a team's jobs,
who may change its roles, and the audit log of who submitted, preempted and cancelled."""

from pathlib import Path

import pytest

from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler import team_store
from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.lifecycle import JobState
from fedge.edge_manager.scheduler.policy import Policy
from fedge.edge_manager.scheduler.service import (
    add_team,
    cancel,
    fleet_stations,
    grant,
    revoke,
    round_boundary,
    set_priority,
    submit_job,
    tick,
)
from fedge.edge_manager.scheduler.teams import (
    Membership,
    TeamRole,
    check_grant,
    check_may_submit,
    check_revoke,
    parse_role,
    visible_teams,
)
from fedge.edge_manager.store import Store

ADMIN, SUBMITTER, VIEWER = TeamRole.ADMIN, TeamRole.SUBMITTER, TeamRole.VIEWER


def test_an_open_team_lets_anyone_submit_a_closed_one_its_submitters_and_admins() -> None:
    check_may_submit("vision", {}, "anyone")
    check_may_submit("vision", {"ana": ADMIN, "bo": SUBMITTER}, "bo")
    check_may_submit("vision", {"ana": ADMIN, "bo": SUBMITTER}, "ana")
    with pytest.raises(SchedulerError, match="cy is not a member of team vision"):
        check_may_submit("vision", {"ana": ADMIN}, "cy")
    with pytest.raises(SchedulerError, match="cy is a viewer of team vision"):
        check_may_submit("vision", {"ana": ADMIN, "cy": VIEWER}, "cy")


def test_a_team_always_keeps_an_admin() -> None:
    with pytest.raises(SchedulerError, match="grant an admin first"):
        check_grant("vision", {}, "bo", SUBMITTER)
    check_grant("vision", {}, "ana", ADMIN)
    with pytest.raises(SchedulerError, match="without an admin"):
        check_grant("vision", {"ana": ADMIN, "bo": SUBMITTER}, "ana", VIEWER)
    check_grant("vision", {"ana": ADMIN, "bo": ADMIN}, "ana", VIEWER)
    with pytest.raises(SchedulerError, match="without an admin"):  # the only member, too
        check_grant("vision", {"ana": ADMIN}, "ana", SUBMITTER)
    with pytest.raises(SchedulerError, match="without an admin"):
        check_revoke("vision", {"ana": ADMIN, "bo": SUBMITTER}, "ana")
    check_revoke("vision", {"ana": ADMIN}, "ana")  # the last member: the team is open again
    with pytest.raises(SchedulerError, match="holds no role"):
        check_revoke("vision", {"ana": ADMIN}, "bo")
    with pytest.raises(SchedulerError, match="viewer, submitter, admin"):
        parse_role("owner")


def test_visible_teams_are_the_members_own() -> None:
    memberships = [
        Membership("vision", "ana", ADMIN, 0.0, "ana"),
        Membership("paint", "ana", VIEWER, 0.0, "bo"),
        Membership("paint", "bo", ADMIN, 0.0, "bo"),
    ]
    assert visible_teams(memberships, "ana") == {"vision", "paint"}
    assert visible_teams(memberships, "bo") == {"paint"}
    assert visible_teams(memberships, "cy") == frozenset()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    opened = Store(tmp_path / "manager.db")
    for name in ("st-1", "st-2"):
        edge_store.enroll(opened, name, "0" * 64, 0.0)
    for team in ("vision", "paint"):
        add_team(opened, team, None, who="root", now=0.0)
    grant(opened, "vision", "ana", ADMIN, who="root", now=1.0)
    grant(opened, "vision", "bo", SUBMITTER, who="ana", now=1.0)
    grant(opened, "vision", "vi", VIEWER, who="ana", now=1.0)
    grant(opened, "paint", "pia", ADMIN, who="root", now=1.0)
    return opened


def _submit(store: Store, job_id: str, team: str, who: str, **kwargs: object) -> None:
    spec: dict[str, object] = {
        "kind": "be",
        "team": team,
        "stations": "any 1",
        "grace_s": 60.0,
        "max_preemptions": 1,
        "priority": 0,
        "job_dir": f"/jobs/{job_id}",
        "who": who,
        "now": 10.0,
        "job_id": job_id,
    }
    spec.update(kwargs)
    submit_job(store, **spec)  # type: ignore[arg-type]


def test_a_submitter_of_another_team_is_refused_and_nothing_is_queued(store: Store) -> None:
    for who, message in (
        ("pia", "pia is not a member of team vision"),
        ("vi", "vi is a viewer of team vision"),
    ):
        with pytest.raises(SchedulerError, match=message):
            _submit(store, "j", "vision", who)
    with pytest.raises(SchedulerError, match=r"unknown team 'lab'.*fedge team add lab"):
        _submit(store, "j", "lab", "ana")
    assert queue_store.jobs(store) == []
    _submit(store, "j", "vision", "bo")
    assert queue_store.job(store, "j").submitted_by == "bo"


def test_a_user_of_another_team_cannot_cancel_or_reprioritise(store: Store) -> None:
    _submit(store, "j", "vision", "bo")
    for who in ("pia", "vi", "stranger"):
        with pytest.raises(SchedulerError, match=f"{who} is"):
            cancel(store, "j", who=who, now=11.0)
        with pytest.raises(SchedulerError, match=f"{who} is"):
            set_priority(store, "j", 5, who=who, now=11.0)
    record = queue_store.job(store, "j")
    assert (record.state, record.job.priority) == (JobState.QUEUED, 0)
    assert [e.who for e in queue_store.events(store, "j")] == ["bo"]
    assert cancel(store, "j", who="ana", now=12.0).state is JobState.CANCELLED


def test_only_a_team_admin_changes_its_roles_and_quota(store: Store) -> None:
    with pytest.raises(SchedulerError, match=r"only an admin of team vision \(ana\)"):
        grant(store, "vision", "cy", SUBMITTER, who="bo", now=2.0)
    with pytest.raises(SchedulerError, match="only an admin of team vision"):
        add_team(store, "vision", 10.0, who="pia", now=2.0)
    with pytest.raises(SchedulerError, match="no operator or console account 'cy'"):
        grant(store, "vision", "cy", SUBMITTER, who="ana", now=2.0, known=frozenset({"bo"}))
    with pytest.raises(SchedulerError, match="unknown team 'lab'"):
        grant(store, "lab", "cy", ADMIN, who="ana", now=2.0)
    assert team_store.members(store, "vision") == {"ana": ADMIN, "bo": SUBMITTER, "vi": VIEWER}
    add_team(store, "vision", 10.0, who="ana", now=2.0)
    assert queue_store.teams(store)["vision"] == 10.0
    revoke(store, "vision", "bo", who="ana")
    with pytest.raises(SchedulerError, match="bo is not a member"):
        _submit(store, "j", "vision", "bo")
    grant(store, "vision", "vi", SUBMITTER, who="ana", now=3.0)
    assert team_store.members(store, "vision") == {"ana": ADMIN, "vi": SUBMITTER}


def test_a_team_over_its_station_hours_waits(store: Store) -> None:
    add_team(store, "paint", 0.5, who="pia", now=0.0)  # half a station-hour a day
    _submit(store, "first", "paint", "pia", stations="any 2", now=0.0)
    stations = fleet_stations(store)
    assert [p.job_id for p in tick(store, Policy(), stations, 1.0).start] == ["first"]
    cancel(store, "first", who="pia", now=1000.0)  # held 2 stations for ~1000 s: 0.55 h
    round_boundary(store, "first", now=1000.0)
    _submit(store, "second", "paint", "pia", now=1001.0)
    _submit(store, "seen", "vision", "bo", now=1002.0)
    started = tick(store, Policy(), stations, 1003.0).start
    assert [p.job_id for p in started] == ["seen"]
    assert queue_store.job(store, "second").state is JobState.QUEUED


def test_the_audit_log_says_who_submitted_preempted_and_cancelled(store: Store) -> None:
    _submit(store, "routine", "vision", "bo", stations="st-1,st-2", now=1.0)
    tick(store, Policy(), fleet_stations(store), 2.0)
    _submit(store, "urgent", "paint", "pia", kind="te", stations="any 1", now=3.0)
    tick(store, Policy(), fleet_stations(store), 4.0)
    cancel(store, "urgent", who="pia", now=5.0)
    routine = queue_store.events(store, "routine")
    assert [(e.state, e.who) for e in routine] == [
        ("queued", "bo"),
        ("running", "scheduler"),
        ("suspending", "scheduler"),
    ]
    assert routine[2].detail == ("preempted for urgent (team paint, submitted by pia; FitGpp)")
    assert [(e.state, e.who) for e in queue_store.events(store, "urgent")] == [
        ("queued", "pia"),
        ("cancelled", "pia"),
    ]

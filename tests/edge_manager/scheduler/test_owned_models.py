"""A team owns its models (issue 31 item 4): the version a team's queued job published is
the team's; only its members and the console's admins see a closed team's versions, and
only its submitters and admins deploy them; a version no team owns is everyone's."""

from pathlib import Path

import pytest

from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.scheduler import model_team_store, owned_models, service
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.lifecycle import JobState
from fedge.edge_manager.scheduler.teams import TeamRole, check_may_deploy, may_see
from fedge.edge_manager.store import Store

ADMIN, SUBMITTER, VIEWER = TeamRole.ADMIN, TeamRole.SUBMITTER, TeamRole.VIEWER


def test_who_sees_a_teams_model() -> None:
    assert may_see(None, {"ana": ADMIN}, "cy", admin=False)  # no team's: everyone's
    assert may_see("vision", {}, "cy", admin=False)  # an open team's: everyone's
    assert may_see("vision", {"ana": ADMIN, "cy": VIEWER}, "cy", admin=False)
    assert not may_see("vision", {"ana": ADMIN}, "cy", admin=False)
    assert may_see("vision", {"ana": ADMIN}, "boss", admin=True)


def test_who_deploys_a_teams_model() -> None:
    check_may_deploy("inspect:3", "vision", {}, "cy")
    check_may_deploy("inspect:3", "vision", {"ana": ADMIN, "bo": SUBMITTER}, "bo")
    with pytest.raises(SchedulerError, match="inspect:3 belongs to team vision and cy holds no"):
        check_may_deploy("inspect:3", "vision", {"ana": ADMIN}, "cy")
    with pytest.raises(SchedulerError, match="only a viewer's role"):
        check_may_deploy("inspect:3", "vision", {"ana": ADMIN, "cy": VIEWER}, "cy")


def _store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "manager.db")
    edge_store.enroll(store, "st-1", "0" * 64, 0.0)
    for team, admin in (("vision", "ana"), ("paint", "pia"), ("open", "")):
        service.add_team(store, team, 2.0, who="root", now=0.0)
        if admin:
            service.grant(store, team, admin, ADMIN, who="root", now=0.0)
    return store


def test_the_team_that_queued_a_job_owns_the_model_it_published(tmp_path: Path) -> None:
    store = _store(tmp_path)
    job_dir = tmp_path / "jobs" / "learn"
    service.submit_job(
        store, kind="be", team="vision", stations="any 1", grace_s=60.0, max_preemptions=1,
        priority=0, job_dir=str(job_dir.resolve()), who="ana", now=1.0,
    )  # fmt: skip
    assert owned_models.own_published(store, job_dir, "inspect", 4, 2.0) == "vision"
    assert owned_models.own_published(store, tmp_path / "by-hand", "inspect", 5, 2.0) is None
    assert model_team_store.owner(store, "inspect", 4) == "vision"
    assert model_team_store.owner(store, "inspect", 5) is None
    # Published again after a crash: the owner is recorded once and never changes.
    model_team_store.record(store, "inspect", 4, "paint", who="pia", at=3.0)
    assert owned_models.owners(store) == {("inspect", 4): "vision"}
    store.close()


def test_hidden_versions_and_deploy_checks_over_the_store(tmp_path: Path) -> None:
    store = _store(tmp_path)
    owned_models.own(store, "inspect", 1, "vision", who="ana", now=1.0)
    owned_models.own(store, "paint", 1, "paint", who="pia", now=1.0)
    owned_models.own(store, "shared", 1, "open", who="anyone", now=1.0)
    with pytest.raises(SchedulerError, match="cy is not a member of team vision"):
        owned_models.own(store, "inspect", 2, "vision", who="cy", now=1.0)
    with pytest.raises(SchedulerError, match="unknown team 'nope'"):
        owned_models.check_team(store, "nope", "ana")
    assert model_team_store.owner(store, "inspect", 2) is None  # refused: nothing recorded
    assert owned_models.hidden(store, "ana", admin=False) == {("paint", 1)}
    assert owned_models.hidden(store, "cy", admin=False) == {("paint", 1), ("inspect", 1)}
    assert owned_models.hidden(store, "cy", admin=True) == frozenset()
    owned_models.check_deploy(store, "inspect", 1, None)  # no --as: as before teams
    owned_models.check_deploy(store, "inspect", 1, "ana")
    owned_models.check_deploy(store, "other", 1, "cy")  # no team's
    with pytest.raises(SchedulerError, match="belongs to team paint"):
        owned_models.check_deploy(store, "paint", 1, "ana")
    store.close()


def test_station_hours_used_in_the_last_day(tmp_path: Path) -> None:
    store = _store(tmp_path)
    record = service.submit_job(
        store, kind="be", team="vision", stations="any 1", grace_s=60.0, max_preemptions=1,
        priority=0, job_dir="", who="ana", now=0.0,
    )  # fmt: skip
    idle = owned_models.used_station_hours(store, 10.0)
    assert idle == {"open": 0.0, "paint": 0.0, "vision": 0.0}
    queue_store.transition(store, record.job.job_id, JobState.RUNNING, who="scheduler", at=0.0)
    assert owned_models.used_station_hours(store, 7200.0)["vision"] == pytest.approx(2.0)
    store.close()

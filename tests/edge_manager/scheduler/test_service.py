"""The queue on the manager's real SQLite store: submissions checked, every state change
stored with who made it, FitGpp preemption recorded, and a reopened store intact."""

from pathlib import Path

import pytest

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.lifecycle import JobState
from fedge.edge_manager.scheduler.policy import Policy
from fedge.edge_manager.scheduler.queue import Placement, Suspension
from fedge.edge_manager.scheduler.service import (
    cancel,
    fleet_stations,
    round_boundary,
    submit_job,
    tick,
)
from fedge.edge_manager.store import Store
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig, TrainingPolicy
from fedge.protocols.errors import ValidationError

POLICY = Policy()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    opened = Store(tmp_path / "manager.db")
    for name in ("st-1", "st-2", "st-3"):
        edge_store.enroll(opened, name, "0" * 64, 0.0)
    queue_store.add_team(opened, "vision", None, 0.0)
    queue_store.add_team(opened, "paint", 0.0, 0.0)
    return opened


def submit(store: Store, job_id: str, kind: str = "be", **kwargs: object) -> None:
    spec: dict[str, object] = {
        "kind": kind,
        "team": "vision",
        "stations": "any 1",
        "grace_s": 60.0,
        "max_preemptions": 1,
        "priority": 0,
        "job_dir": f"/jobs/{job_id}",
        "who": "ana",
        "now": 10.0,
        "job_id": job_id,
    }
    spec.update(kwargs)
    submit_job(store, **spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"team": "nobody"}, "unknown team 'nobody'"),
        ({"stations": "st-1,st-9"}, "unknown stations: st-9"),
        ({"stations": "any 4"}, "only 3 enrolled"),
        ({"stations": "any two"}, "whole number"),
        ({"grace_s": 0.0}, "grace period"),
        ({"kind": "urgent"}, "give te"),
    ],
)
def test_bad_submissions_are_refused_and_queue_nothing(
    store: Store, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(SchedulerError, match=message):
        submit(store, "bad", **kwargs)  # type: ignore[arg-type]
    assert queue_store.jobs(store) == []


def test_stations_specs(store: Store) -> None:
    submit(store, "all", stations="all")
    submit(store, "some", stations="any 2 of st-1,st-3")
    submit(store, "listed", stations="st-2,st-3")
    by_id = {r.job.job_id: r.job for r in queue_store.jobs(store)}
    assert (by_id["all"].demand, by_id["all"].stations) == (3, frozenset({"st-1", "st-2", "st-3"}))
    assert (by_id["some"].demand, by_id["some"].stations) == (2, frozenset({"st-1", "st-3"}))
    assert (by_id["listed"].demand, by_id["listed"].stations) == (2, frozenset({"st-2", "st-3"}))


def test_a_te_job_preempts_at_a_round_boundary_and_the_be_job_resumes(store: Store) -> None:
    submit(store, "be-big", stations="any 3", grace_s=120.0)
    stations = fleet_stations(store)
    assert tick(store, POLICY, stations, 20.0).start == (
        Placement("be-big", ("st-1", "st-2", "st-3")),
    )
    submit(store, "te-1", kind="te", stations="any 1", now=30.0)
    assert tick(store, POLICY, stations, 30.0).suspend == (Suspension("be-big", "te-1"),)
    # Until the BE job reports its round boundary the TE job waits; nothing is asked twice.
    assert tick(store, POLICY, stations, 40.0) == tick(store, POLICY, stations, 41.0)
    assert queue_store.job(store, "be-big").state is JobState.SUSPENDING
    round_boundary(store, "be-big", now=60.0, detail="checkpoint round 4")
    assert tick(store, POLICY, stations, 60.0).start == (Placement("te-1", ("st-1",)),)
    queue_store.transition(store, "te-1", JobState.COMPLETED, who="runner", at=90.0)
    assert tick(store, POLICY, stations, 90.0).resume == (
        Placement("be-big", ("st-1", "st-2", "st-3")),
    )
    record = queue_store.job(store, "be-big")
    assert (record.state, record.preemptions, record.ran_s) == (JobState.RUNNING, 1, 10.0)
    assert [(e.state, e.who) for e in queue_store.events(store, "be-big")] == [
        ("queued", "ana"),
        ("running", "scheduler"),
        ("suspending", "scheduler"),
        ("suspended", "scheduler"),
        ("running", "scheduler"),
    ]
    assert "preempted for te-1" in queue_store.events(store, "be-big")[2].detail


def test_a_reopened_store_keeps_the_suspended_job_and_its_place(
    store: Store, tmp_path: Path
) -> None:
    submit(store, "be-old", stations="any 3", now=1.0)
    tick(store, POLICY, fleet_stations(store), 2.0)
    submit(store, "te-1", kind="te", now=3.0)
    submit(store, "be-new", now=4.0)
    tick(store, POLICY, fleet_stations(store), 5.0)
    round_boundary(store, "be-old", now=6.0)
    store.close()  # the manager goes away with the job suspended
    reopened = Store(tmp_path / "manager.db")
    assert queue_store.job(reopened, "be-old").state is JobState.SUSPENDED
    actions = tick(reopened, POLICY, fleet_stations(reopened), 7.0)
    # TE first, then the suspended BE job ahead of the newer one: it needs all 3, so the
    # newer one waits behind it (FIFO, no backfilling).
    assert actions.start == (Placement("te-1", ("st-1",)),)
    assert actions.resume == ()


def test_cancel_frees_the_stations_at_the_next_round_boundary(store: Store) -> None:
    submit(store, "first", stations="any 3", now=1.0)
    submit(store, "second", stations="any 3", now=2.0)
    stations = fleet_stations(store)
    tick(store, POLICY, stations, 3.0)
    assert cancel(store, "second", who="ana", now=4.0).state is JobState.CANCELLED
    assert cancel(store, "first", who="ana", now=4.0).state is JobState.CANCELLING
    submit(store, "third", stations="any 1", now=5.0)
    assert tick(store, POLICY, stations, 5.0).start == ()
    round_boundary(store, "first", now=6.0)
    assert tick(store, POLICY, stations, 6.0).start == (Placement("third", ("st-1",)),)
    with pytest.raises(SchedulerError, match="cannot become"):
        cancel(store, "first", who="ana", now=7.0)


def test_a_team_over_its_quota_waits(store: Store) -> None:
    submit(store, "painted", team="paint", now=1.0)
    submit(store, "seen", now=2.0)
    assert tick(store, POLICY, fleet_stations(store), 3.0).start == (Placement("seen", ("st-1",)),)
    assert queue_store.job(store, "painted").state is JobState.QUEUED


def test_priority_changes_only_while_waiting(store: Store) -> None:
    submit(store, "a", stations="any 3", now=1.0)
    submit(store, "b", now=2.0)
    submit(store, "c", now=3.0)
    tick(store, POLICY, fleet_stations(store), 4.0)
    queue_store.set_priority(store, "c", 5, who="ana", at=5.0)
    assert queue_store.events(store, "c")[-1].detail == "priority 0 -> 5"
    with pytest.raises(SchedulerError, match="only a waiting job"):
        queue_store.set_priority(store, "a", 5, who="ana", at=5.0)
    round_boundary_free = queue_store.transition(store, "a", JobState.COMPLETED, who="r", at=6.0)
    assert round_boundary_free.state is JobState.COMPLETED
    started = tick(store, POLICY, fleet_stations(store), 6.0).start
    assert [p.job_id for p in started] == ["c", "b"]


def push_training(store: Store, edge: str, policy: TrainingPolicy) -> None:
    config = EdgeConfig(fleet="plant-a", edge=edge, version=1, training=policy)
    with store.transaction() as conn:
        desired_store.write(conn, edge, desired_store.CONFIG, 1, codec.encode(config).decode(),
                            "signed", 0.0)  # fmt: skip


def test_windows_come_from_the_stations_signed_config(store: Store) -> None:
    # st-1 trains on the night shift (UTC+1), st-2 once its line was idle 30 minutes.
    night = TrainingPolicy(enabled=True, windows=("22:00-06:00",), utc_offset_minutes=60)
    push_training(store, "st-1", night)
    push_training(store, "st-2", TrainingPolicy(enabled=True, windows=("idle 30m",)))
    noon = 12 * 3600.0
    store.conn.execute(
        "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
        "threshold, config_version, latency_ms, source) VALUES "
        "('p1', 'st-2', 1, ?, 'inspect:1', '{}', 'ok', 0.5, 1, 1.0, 'test')",
        (noon - 600.0,),
    )
    submit(store, "any", stations="any 1", now=1.0)
    submit(store, "night", stations="st-1", now=2.0)
    submit(store, "idle", stations="st-2", now=3.0)
    # At noon st-1 is off shift and st-2 scored 10 minutes ago: only st-3 may train; the
    # jobs pinned elsewhere are passed over and wait.
    assert tick(store, POLICY, fleet_stations(store), noon).start == (Placement("any", ("st-3",)),)
    assert tick(store, POLICY, fleet_stations(store), noon + 1200.0).start == (
        Placement("idle", ("st-2",)),
    )
    # 21:30 UTC is 22:30 at UTC+1: the night shift is open.
    assert tick(store, POLICY, fleet_stations(store), 21.5 * 3600).start == (
        Placement("night", ("st-1",)),
    )


def test_a_malformed_window_is_refused_before_it_is_signed() -> None:
    for window in ("25:00-06:00", "idle 0m", "always"):
        with pytest.raises(ValidationError, match=r"training\.windows"):
            TrainingPolicy(enabled=True, windows=(window,))
    with pytest.raises(ValidationError, match="empty"):
        TrainingPolicy(enabled=True, windows=())

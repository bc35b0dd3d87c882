"""The queue carried out on fleet jobs, against the in-memory twin of the fleet-job
machinery and the manager's real SQLite store: FitGpp's suspension at a round boundary,
a resume on the job's own stations, and a start recorded before a crash submitted once."""

from pathlib import Path

import pytest

from fedge.aggregator.jobs.directory import JobError
from fedge.aggregator.jobs.run_store import RunState
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.lifecycle import JobState
from fedge.edge_manager.scheduler.policy import Policy
from fedge.edge_manager.scheduler.queue import Placement, Station, Suspension
from fedge.edge_manager.scheduler.service import cancel, fleet_stations, submit_job, tick
from fedge.edge_manager.scheduler.store import JobRecord
from fedge.edge_manager.scheduler.windows import ShiftWindow
from fedge.edge_manager.store import Store
from fedge.federation.queue_runner import InMemoryFleetJobs, QueueRunner


@pytest.fixture
def store(tmp_path: Path) -> Store:
    opened = Store(tmp_path / "manager.db")
    for name in ("st-1", "st-2", "st-3", "st-4"):
        edge_store.enroll(opened, name, "0" * 64, 0.0)
    queue_store.add_team(opened, "vision", None, 0.0)
    return opened


def submit(store: Store, job_id: str, kind: str, stations: str, now: float) -> None:
    submit_job(
        store,
        kind=kind,
        team="vision",
        stations=stations,
        grace_s=120.0,
        max_preemptions=1,
        priority=0,
        job_dir=f"/jobs/{job_id}",
        who="ana",
        now=now,
        job_id=job_id,
    )


def runner(store: Store, fleet: InMemoryFleetJobs) -> QueueRunner:
    return QueueRunner(store, fleet, Policy(), lambda: fleet_stations(store))


def test_a_te_job_suspends_a_be_job_at_its_round_boundary(store: Store) -> None:
    fleet = InMemoryFleetJobs()
    run = runner(store, fleet)
    submit(store, "be", "be", "any 3", 1.0)
    submit(store, "filler", "be", "st-4", 1.5)
    assert run.step(2.0).start == (
        Placement("be", ("st-1", "st-2", "st-3")),
        Placement("filler", ("st-4",)),
    )
    fleet.round_ends("be")
    submit(store, "te", "te", "any 2", 3.0)
    assert run.step(3.0).suspend == (Suspension("be", "te"),)
    assert fleet.halt_requested == {"be"}
    assert run.step(4.0) == run.step(5.0)  # waiting for the round: nothing asked twice
    fleet.round_ends("be")  # the round ends, the checkpoint is written, the run halts
    assert run.step(6.0).start == (Placement("te", ("st-1", "st-2")),)
    assert queue_store.job(store, "be").state is JobState.SUSPENDED
    fleet.finish("te")
    # be was pinned to its stations at its first start: it resumes there, not on "any 3".
    assert run.step(7.0).resume == (Placement("be", ("st-1", "st-2", "st-3")),)
    fleet.finish("be")
    fleet.finish("filler")
    run.step(8.0)
    assert fleet.submissions == {"be": 2, "filler": 1, "te": 1}
    assert sorted(fleet.published) == ["be", "filler", "te"]
    assert [queue_store.job(store, j).state for j in ("be", "te", "filler")] == [
        JobState.COMPLETED
    ] * 3
    assert [e.state for e in queue_store.events(store, "be")] == [
        "queued",
        "running",
        "suspending",
        "suspended",
        "running",
        "completed",
    ]


def test_a_start_recorded_before_a_crash_is_submitted_once(store: Store) -> None:
    submit(store, "be", "be", "any 2", 1.0)
    # The manager recorded the start, then died before it submitted the job.
    tick(store, Policy(), fleet_stations(store), 2.0, pin_stations=True)
    fleet = InMemoryFleetJobs()
    run = runner(store, fleet)
    run.step(3.0)
    run.step(4.0)
    assert fleet.submissions == {"be": 1}
    assert fleet.stations["be"] == ("st-1", "st-2")


def test_a_job_halted_by_an_operator_keeps_its_place(store: Store) -> None:
    fleet = InMemoryFleetJobs()
    run = runner(store, fleet)
    submit(store, "be", "be", "all", 1.0)
    run.step(2.0)
    fleet.operator_halt("be", at=2.5)  # fedge aggregator halt, outside the scheduler
    actions = run.step(3.0)
    # Observed as suspended, then resumed by the same step: it is still first in line.
    assert actions.resume == (Placement("be", ("st-1", "st-2", "st-3", "st-4")),)
    assert "halted outside the scheduler" in [e.detail for e in queue_store.events(store, "be")]


def test_a_station_set_too_small_for_a_pinned_job_is_waited_for(store: Store) -> None:
    fleet = InMemoryFleetJobs()
    stations = [Station(s) for s in ("st-1", "st-2", "st-3", "st-4")]
    run = QueueRunner(store, fleet, Policy(), lambda: stations)
    submit(store, "be", "be", "any 2", 1.0)
    run.step(2.0)
    fleet.operator_halt("be", at=2.5)
    stations[1] = Station("st-2", slots=0)  # st-2 stops training
    assert run.step(3.0).resume == ()
    submit(store, "other", "be", "any 1", 4.0)
    # be cannot run anywhere else, so it is passed over and does not block "other".
    assert run.step(4.0).start == (Placement("other", ("st-1",)),)


def preempted(store: Store, fleet: InMemoryFleetJobs, run: QueueRunner) -> None:
    """be (all 4 stations) suspended for te at its round boundary; te running."""
    submit(store, "be", "be", "all", 1.0)
    run.step(2.0)
    submit(store, "te", "te", "any 2", 3.0)
    run.step(3.0)
    fleet.round_ends("be", at=3.5)
    run.step(4.0)
    assert queue_store.job(store, "te").state is JobState.RUNNING


def test_a_resume_recorded_but_not_made_is_made_not_suspended_again(store: Store) -> None:
    fleet = InMemoryFleetJobs()
    run = runner(store, fleet)
    preempted(store, fleet, run)
    fleet.finish("te")
    queue_store.transition(store, "te", JobState.COMPLETED, who="scheduler", at=5.0)
    # The manager records be's resume, then dies before it submits it (review finding).
    assert tick(store, Policy(), fleet_stations(store), 6.0, pin_stations=True).resume
    # Its run still says halted (at 3.5, before the resume at 6.0): the resume is made.
    assert run.step(7.0).suspend == ()
    record = queue_store.job(store, "be")
    assert (record.state, record.preemptions) == (JobState.RUNNING, 1)
    assert fleet.submissions["be"] == 2
    assert [e.state for e in queue_store.events(store, "be")][-2:] == ["suspended", "running"]


def test_a_grace_period_spent_stops_the_job_and_frees_its_stations(store: Store) -> None:
    fleet = InMemoryFleetJobs()
    run = runner(store, fleet)
    submit(store, "be", "be", "all", 1.0)
    run.step(2.0)
    submit(store, "te", "te", "any 2", 3.0)
    run.step(3.0)  # be asked to halt at t=3; its grace is 120 s; the round never ends
    assert run.step(100.0).start == () and fleet.forced == []
    assert run.step(123.5).start == (Placement("te", ("st-1", "st-2")),)
    assert fleet.forced == ["be"]
    assert "grace period 120 s spent" in queue_store.events(store, "be")[-1].detail


def test_cancel_frees_the_stations_at_the_next_round_boundary(store: Store) -> None:
    fleet = InMemoryFleetJobs()
    run = runner(store, fleet)
    submit(store, "be", "be", "all", 1.0)
    run.step(2.0)
    submit(store, "next", "be", "any 1", 3.0)
    cancel(store, "be", who="ana", now=4.0)
    assert run.step(5.0).start == ()  # the round goes on; the halt is asked
    assert fleet.halt_requested == {"be"}
    fleet.round_ends("be", at=6.0)
    assert run.step(7.0).start == (Placement("next", ("st-1",)),)
    assert queue_store.job(store, "be").state is JobState.CANCELLED
    assert fleet.submissions["be"] == 1


def test_a_dead_aggregator_is_submitted_again(store: Store) -> None:
    fleet = InMemoryFleetJobs()
    run = runner(store, fleet)
    submit(store, "be", "be", "any 1", 1.0)
    run.step(2.0)
    fleet.dead.add("be")
    run.step(3.0)
    assert fleet.submissions["be"] == 2
    assert queue_store.job(store, "be").preemptions == 0


def test_a_start_the_fleet_refuses_fails_that_job_only(store: Store) -> None:
    class Refusing(InMemoryFleetJobs):
        def start(self, record: JobRecord, stations: tuple[str, ...]) -> None:
            if record.job.job_id == "bad":
                raise JobError("the SuperLink refused the job")
            super().start(record, stations)

    fleet = Refusing()
    run = runner(store, fleet)
    submit(store, "bad", "be", "any 1", 1.0)
    submit(store, "good", "be", "any 1", 1.5)
    run.step(2.0)
    assert queue_store.job(store, "bad").state is JobState.FAILED
    assert "refused by the fleet" in queue_store.events(store, "bad")[-1].detail
    assert queue_store.job(store, "good").state is JobState.RUNNING


def test_a_station_leaving_its_window_mid_round_finishes_the_round(store: Store) -> None:
    fleet = InMemoryFleetJobs()
    day = (ShiftWindow.parse("06:00-18:00"),)
    stations = [Station("st-1", windows=day), Station("st-2")]
    run = QueueRunner(store, fleet, Policy(), lambda: stations)
    submit(store, "be", "be", "any 2", 1.0)
    assert run.step(7 * 3600.0).start == (Placement("be", ("st-1", "st-2")),)
    # 18:00: st-1's shift ends mid-round. The round goes on; the job is asked to stop after it.
    evening = 18 * 3600.0 + 60
    run.step(evening)
    assert queue_store.job(store, "be").state is JobState.SUSPENDING
    assert fleet.halt_requested == {"be"} and fleet.states["be"] is RunState.RUNNING
    fleet.round_ends("be", at=evening + 30)
    run.step(evening + 60)
    assert queue_store.job(store, "be").state is JobState.SUSPENDED
    # Not asked again until the window opens: at night nothing resumes, at 06:00 it does.
    assert run.step(23 * 3600.0).resume == ()
    assert run.step(30 * 3600.0).resume == (Placement("be", ("st-1", "st-2")),)
    assert "st-1 left its training window" in queue_store.events(store, "be")[2].detail

"""Team quotas: station time held inside the last 24 hours, by hand-computed cases."""

from pathlib import Path

from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.policy import Policy
from fedge.edge_manager.scheduler.queue import Placement
from fedge.edge_manager.scheduler.quota import HoldEvent, used_station_seconds
from fedge.edge_manager.scheduler.service import fleet_stations, submit_job, tick
from fedge.edge_manager.store import Store

HOUR = 3600.0
DAY = 24 * HOUR


def ev(job_id: str, at: float, state: str, demand: int = 2, team: str = "vision") -> HoldEvent:
    return HoldEvent(job_id, team, demand, at, state)


def test_held_time_counts_only_inside_the_window() -> None:
    events = [
        # a: 2 stations from 10 h before the window to 1 h into it, then suspended.
        ev("a", -10 * HOUR, "queued"),
        ev("a", -10 * HOUR, "running"),
        ev("a", 0.5 * HOUR, "suspending"),  # still holds them while it finishes its round
        ev("a", 1 * HOUR, "suspended"),
        # b: 3 stations, placed 2 h before now and still running.
        ev("b", 20 * HOUR, "queued", demand=3),
        ev("b", 22 * HOUR, "running", demand=3),
        # c: another team, waiting only: nothing held.
        ev("c", 5 * HOUR, "queued", team="paint"),
    ]
    used = used_station_seconds(events, since=0.0, now=DAY)
    assert used == {"vision": 2 * 1 * HOUR + 3 * 2 * HOUR, "paint": 0.0}


def test_a_job_submitted_days_ago_and_still_running_counts_today(tmp_path: Path) -> None:
    store = Store(tmp_path / "manager.db")
    for name in ("st-1", "st-2", "st-3"):
        edge_store.enroll(store, name, "0" * 64, 0.0)
    queue_store.add_team(store, "vision", 20.0, 0.0)  # 20 station-hours a day

    def submit(job_id: str, stations: str, now: float) -> None:
        submit_job(store, kind="be", team="vision", stations=stations, grace_s=60.0,
                   max_preemptions=1, priority=0, job_dir="", who="ana", now=now,
                   job_id=job_id)  # fmt: skip

    submit("long", "any 2", 0.0)
    assert tick(store, Policy(), fleet_stations(store), 1.0).start  # on 2 stations
    submit("next", "any 1", 3 * DAY)
    # Three days on, "long" has held 2 stations for all of the last 24 h: 48 station-hours,
    # over the 20 a day, so the team's next job waits though a station is free.
    assert tick(store, Policy(), fleet_stations(store), 3 * DAY).start == ()
    queue_store.add_team(store, "vision", 50.0, 3 * DAY)
    assert tick(store, Policy(), fleet_stations(store), 3 * DAY + 1).start == (
        Placement("next", ("st-3",)),
    )
    store.close()

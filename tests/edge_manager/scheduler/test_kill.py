"""A manager process SIGKILLed while it schedules (issue 31): after a restart the queue is
as the last committed change left it -- the suspended job suspended, in its place, every
job's row and its audit log in step -- and the next decision starts nothing twice."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import wait_until

from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.lifecycle import JobState
from fedge.edge_manager.scheduler.policy import Policy
from fedge.edge_manager.scheduler.queue import Placement
from fedge.edge_manager.scheduler.service import fleet_stations, tick
from fedge.edge_manager.store import Store

pytestmark = pytest.mark.integration

# The "manager": builds a queue with a suspended BE job, then changes priorities in a
# tight loop (each one a transaction: the row and its event) until it is killed.
SCRIPT = textwrap.dedent(
    """
    import sys
    from fedge.edge_manager.fleet import edge_store
    from fedge.edge_manager.scheduler import store as queue_store
    from fedge.edge_manager.scheduler.policy import Policy
    from fedge.edge_manager.scheduler.service import (
        fleet_stations, round_boundary, submit_job, tick,
    )
    from fedge.edge_manager.store import Store

    store = Store(sys.argv[1])
    for name in ("st-1", "st-2", "st-3"):
        edge_store.enroll(store, name, "0" * 64, 0.0)
    queue_store.add_team(store, "vision", None, 0.0)

    def submit(job_id, kind, stations, now):
        submit_job(store, kind=kind, team="vision", stations=stations, grace_s=60.0,
                   max_preemptions=1, priority=0, job_dir="", who="ana", now=now,
                   job_id=job_id)

    submit("be-old", "be", "any 3", 1.0)
    tick(store, Policy(), fleet_stations(store), 2.0)
    submit("te-1", "te", "any 3", 3.0)
    tick(store, Policy(), fleet_stations(store), 4.0)
    round_boundary(store, "be-old", now=5.0, detail="checkpoint round 2")
    submit("be-new", "be", "any 1", 6.0)
    print("ready", flush=True)
    n = 0
    while True:
        n += 1
        queue_store.set_priority(store, "be-new", n, who="loop", at=7.0 + n)
    """
)


def test_a_killed_manager_keeps_its_queue(tmp_path: Path) -> None:
    db = tmp_path / "manager.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(db)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"

        store = Store(db)
        wait_until(
            lambda: len(queue_store.events(store, "be-new")),
            30,
            "priority changes",
            expect=lambda n: n > 50,
        )
        store.close()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    store = Store(db)  # the restarted manager
    suspended = queue_store.job(store, "be-old")
    assert (suspended.state, suspended.preemptions, suspended.assigned) == (
        JobState.SUSPENDED,
        1,
        (),
    )
    newer = queue_store.job(store, "be-new")
    history = queue_store.events(store, "be-new")
    # Row and log in step: the priority in force is the last one the log records.
    assert history[-1].detail.endswith(f"-> {newer.job.priority}")
    assert newer.job.priority == len(history) - 1  # one event per change, none lost
    # te-1 waits for the stations be-old freed; it starts now, once; be-old stays ahead
    # of be-new in the BE queue.
    stations = fleet_stations(store)
    first = tick(store, Policy(), stations, 10_000.0)
    assert first.start == (Placement("te-1", ("st-1", "st-2", "st-3")),)
    assert tick(store, Policy(), stations, 10_001.0).start == ()
    queue_store.transition(store, "te-1", JobState.COMPLETED, who="runner", at=10_002.0)
    again = tick(store, Policy(), stations, 10_003.0)
    assert again.resume == (Placement("be-old", ("st-1", "st-2", "st-3")),)
    assert again.start == ()
    store.close()

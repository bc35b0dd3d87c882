"""The job queue on a real fleet (issue 31): a BE fleet job on three agents' SuperNodes
is preempted by a TE job at a round boundary, the queue runner is SIGKILLed while the BE
job is suspended, the TE job is cancelled at its next round boundary, and the BE job
resumes from its checkpoint and ends published with every round recorded once.

Real processes throughout: Mosquitto, ``manager serve``, the SuperLink, three ``agent
run`` processes each supervising a ``flower-supernode``, and ``fedge jobs run`` (the
queue runner), which submits the jobs with ``flwr run``.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    FleetHome,
    Processes,
    agent_status,
    dump_flower_logs,
    keep_labelled_images,
    make_fleet_home,
    publish_trainable,
    start_training_plant,
    wait_until,
)

from fedge.aggregator.jobs.checkpoint import checkpoint_rounds
from fedge.aggregator.jobs.run_store import RunStore
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.lifecycle import JobState

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02", "st-03")
BE_GRACE_S = 60.0
BE_ROUNDS = 4
TE_ROUNDS = 3
JOB = """
[job]
name = "{name}"
rounds = {rounds}

[task]
model = "inspect:1"
lr = 0.003
local_epochs = 1
batch_size = 8

[strategy]
kind = "fedavg"

[federation]
backend = "fleet"
fleet = "plant-a"
edges = "all"
node_wait_s = 240.0
round_timeout_s = 300.0
eval_timeout_s = 240.0
"""


def manifest(tmp_path: Path, name: str, rounds: int) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(JOB.format(name=name, rounds=rounds), encoding="utf-8")
    return path


def training(fh: FleetHome, edge: str, port: int) -> None:
    """Ready, for this test: the station's SuperNode is up (it trains)."""
    wait_until(partial(trains, port), 90, f"{edge}'s SuperNode")


def trains(port: int) -> bool:
    return bool(agent_status(port)["training"]["running"])


def rounds_of(job_dir: Path) -> list[dict[str, Any]]:
    if not (job_dir / "runs.db").exists():
        return []
    store = RunStore(job_dir / "runs.db")
    try:
        runs = store.runs()
        return store.rounds(str(runs[-1]["run_id"])) if runs else []
    finally:
        store.close()


def run_state(job_dir: Path) -> str:
    if not (job_dir / "runs.db").exists():
        return ""
    store = RunStore(job_dir / "runs.db")
    try:
        runs = store.runs()
        return str(runs[-1]["state"]) if runs else ""
    finally:
        store.close()


def round0_evaluated(job_dir: Path) -> float | None:
    store = RunStore(job_dir / "runs.db")
    try:
        return store.last_evaluation_at(str(store.runs()[-1]["run_id"]), 0)
    finally:
        store.close()


def event_at(fh: FleetHome, job_id: str, state: str) -> float:
    return next(e.at for e in queue_store.events(fh.db, job_id) if e.state == state)


def state_of(fh: FleetHome, job_id: str) -> JobState:
    return queue_store.job(fh.db, job_id).state


def submit(processes: Processes, *args: str) -> dict[str, Any]:
    out = processes.cli("jobs", "submit", "--team", "vision", "--json", *args).stdout
    record: dict[str, Any] = json.loads(out)
    return record


@pytest.mark.timeout(1500)
def test_a_te_job_preempts_a_be_fleet_job_which_resumes_and_publishes(
    tmp_path: Path, processes: Processes
) -> None:
    fh = make_fleet_home(tmp_path, edges=EDGES, privacy_floor=False)
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    publish_trainable(fh, tmp_path, EDGES)
    for index, edge in enumerate(EDGES):
        keep_labelled_images(fh.data_dir(edge), seed=70 + index)
    try:
        start_training_plant(fh, processes, tmp_path, EDGES, ready=training)
        processes.cli("jobs", "team", "vision")
        be_dir, te_dir = tmp_path / "be-job", tmp_path / "te-job"
        be = submit(
            processes, "--kind", "be", "--stations", "all", "--grace", str(BE_GRACE_S),
            "--manifest", str(manifest(tmp_path, "routine", BE_ROUNDS)),
            "--job-dir", str(be_dir),
        )["job_id"]  # fmt: skip
        queue = processes.start("queue", "jobs", "run", "--poll", "0.5")
        wait_until(lambda: rounds_of(be_dir), 400, "the BE job's round 1", expect=bool)

        te_record = submit(
            processes, "--kind", "te", "--stations", "all", "--grace", "30",
            "--manifest", str(manifest(tmp_path, "urgent", TE_ROUNDS)),
            "--job-dir", str(te_dir),
        )  # fmt: skip
        te, te_submitted = te_record["job_id"], float(te_record["submitted_at"])
        seen_running: list[float] = []

        def te_rounds() -> list[dict[str, Any]]:
            if not seen_running and run_state(te_dir) == "running":
                seen_running.append(time.time())  # its ServerApp took the job
            return rounds_of(te_dir)

        first = wait_until(te_rounds, 600, "the TE job's round 1", expect=bool)[0]
        handed_over = float(json.loads((te_dir / "submitted.json").read_text())["submitted_at"])
        timeline: dict[str, float | None] = {
            "be_halted": event_at(fh, be, "suspended"),
            "te_placed": event_at(fh, te, "running"),
            "te_submitted_to_superlink": handed_over,
            "te_serverapp_running": seen_running[0] if seen_running else None,
            "te_round0_evaluated": round0_evaluated(te_dir),
            "te_round1_started": first["recorded_at"] - first["round_time_s"],
        }
        figures = {
            key: None if at is None else round(at - te_submitted, 2) for key, at in timeline.items()
        }
        print(json.dumps({"be_grace_s": BE_GRACE_S, "seconds_after_te_submission": figures}))
        # What the scheduler controls -- the BE job stopping at its round boundary (bounded
        # by its grace period) and the TE job placed and handed to the SuperLink -- is
        # within the BE job's grace + 10 s. The TE job's own start-up (its ServerApp, the
        # stations evaluating its starting model) comes on top; the figures say how much.
        assert handed_over - te_submitted <= BE_GRACE_S + 10.0, figures
        assert state_of(fh, be) is JobState.SUSPENDED

        # The queue runner dies while the BE job is suspended; a new one takes over.
        processes.kill(queue)
        suspended = queue_store.job(fh.db, be)
        be_rounds = rounds_of(be_dir)
        assert (suspended.state, suspended.preemptions) == (JobState.SUSPENDED, 1)
        assert checkpoint_rounds(be_dir)[-1] == be_rounds[-1]["round"] < BE_ROUNDS
        queue = processes.start("queue", "jobs", "run", "--poll", "0.5")

        # Cancel the TE job: it frees the stations at its next round boundary.
        processes.cli("jobs", "cancel", te)
        wait_until(lambda: state_of(fh, te), 300, "the TE job cancelled",
                   expect=lambda s: s is JobState.CANCELLED)  # fmt: skip
        assert len(rounds_of(te_dir)) < TE_ROUNDS
        wait_until(lambda: state_of(fh, be), 600, "the BE job to end",
                   expect=lambda s: s in (JobState.COMPLETED, JobState.FAILED))  # fmt: skip

        assert [r["round"] for r in rounds_of(be_dir)] == list(range(1, BE_ROUNDS + 1))
        events = queue_store.events(fh.db, be)
        assert [e.state for e in events] == [
            "queued", "running", "suspending", "suspended", "running", "completed",
        ]  # fmt: skip
        assert events[-1].detail.startswith("published inspect:")
        assert f"preempted for {te}" in events[2].detail
        assert [e.state for e in queue_store.events(fh.db, te)][-2:] == [
            "cancelling",
            "cancelled",
        ]
        assert queue.running()
    except BaseException:
        for proc in processes.procs:
            print(proc.output()[-3000:])
        dump_flower_logs(tmp_path)
        raise

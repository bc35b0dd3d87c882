"""The runner's sequencing: trigger, job, gate, rollout; every step stored; resumable.

The fleet job is replaced here (its own tests run real SuperLinks and SuperNodes: see
tests/test_fleet_learns.py); the gate and the rollout are the runner's two protocols.
"""

from pathlib import Path
from typing import Any

import pytest
from conftest import make_fleet_home, publish_model

from fedge.aggregator.jobs.run_store import RunState as JobState
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.store import Store
from fedge.federation import fleet_job
from fedge.federation.fleet_job import FleetJobResult
from fedge.loop import run_store
from fedge.loop.pipeline import RunState
from fedge.loop.policy import LoopPolicy
from fedge.loop.runner import LoopRunner, Wiring

JOB = '[job]\nname = "nightly"\nrounds = 1\n\n[task]\nmodel = "inspect:1"\n'


class FakeRollout:
    def __init__(self, outcomes: list[tuple[bool | None, str]]) -> None:
        self.outcomes = outcomes
        self.started: list[str] = []

    def start(self, candidate: str, policy: LoopPolicy) -> str:
        self.started.append(candidate)
        return f"ro-{len(self.started)}"

    def find(self, candidate: str) -> str | None:
        return f"ro-{len(self.started)}" if candidate in self.started else None

    def outcome(self, rollout_id: str) -> tuple[bool | None, str]:
        return self.outcomes.pop(0) if self.outcomes else (None, "")


def _home(tmp_path: Path) -> ManagerHome:
    fh = make_fleet_home(tmp_path)
    publish_model(fh, 1)
    return fh.home


def _label(home: ManagerHome, n: int) -> None:
    store = Store(home.db_path)
    for i in range(n):
        store.conn.execute(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
            "threshold, config_version, latency_ms, source) VALUES (?,?,0,?,?,'{}','accept',"
            "0.5,1,1.0,'')",
            (f"p{i}", "st-01", 1000.0 + i, "inspect:1"),
        )
        store.conn.execute(
            "INSERT INTO labels VALUES (?,?,?,?,?,?,?)",
            (f"l{i}", f"p{i}", "st-01", "scratch", "op", 1000.0 + i, "operator"),
        )
    store.close()


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each fake fleet job records the manifest it got and publishes inspect:2."""
    seen: list[str] = []

    def run(manifest: Path, job_dir: Path, home: ManagerHome, **_: Any) -> FleetJobResult:
        seen.append(manifest.read_text())
        return FleetJobResult("r", JobState.COMPLETED, 1, 1, "inspect:2")

    monkeypatch.setattr(fleet_job, "run_fleet_job", run)
    return seen


def test_new_labels_train_gate_and_roll_out(tmp_path: Path, jobs: list[str]) -> None:
    home = _home(tmp_path)
    _label(home, 5)
    store = Store(home.db_path)
    run_store.save_policy(store, LoopPolicy(model="inspect", job=JOB, min_new_labels=5))
    store.close()
    rollout = FakeRollout([(None, ""), (True, "")])
    runner = LoopRunner(home, Wiring(lambda c: (True, "better"), rollout, rollout_poll_s=0.01))
    (run,) = runner.tick()
    assert run.state is RunState.COMPLETED and run.candidate == "inspect:2"
    assert 'model = "inspect:1"' in jobs[0] and rollout.started == ["inspect:2"]
    store = Store(home.db_path)
    steps = [e["step"] for e in run_store.events(store, run.run_id)]
    assert steps == ["triggered", "published", "gated", "rollout_started", "rollout_ended"]
    assert runner.tick() == []  # the labels were used: nothing is due
    store.close()


def test_a_refused_candidate_is_never_rolled_out(tmp_path: Path, jobs: list[str]) -> None:
    home = _home(tmp_path)
    _label(home, 5)
    store = Store(home.db_path)
    run_store.save_policy(store, LoopPolicy(model="inspect", job=JOB, min_new_labels=5))
    store.close()
    rollout = FakeRollout([])
    gate = lambda c: (False, "worse than inspect:1 on st-02 by 0.12")  # noqa: E731
    (run,) = LoopRunner(home, Wiring(gate, rollout)).tick()
    assert run.state is RunState.NOT_BLESSED and "st-02" in run.reason
    assert rollout.started == []


def test_a_killed_runner_resumes_the_rollout_it_was_following(
    tmp_path: Path, jobs: list[str]
) -> None:
    home = _home(tmp_path)
    _label(home, 5)
    store = Store(home.db_path)
    run_store.save_policy(store, LoopPolicy(model="inspect", job=JOB, min_new_labels=5))
    store.close()

    class Dies(FakeRollout):
        def outcome(self, rollout_id: str) -> tuple[bool | None, str]:
            raise KeyboardInterrupt  # the runner is killed while it follows the rollout

    first = Dies([])
    with pytest.raises(KeyboardInterrupt):
        LoopRunner(home, Wiring(lambda c: (True, ""), first)).tick()
    after = FakeRollout([(False, "canary st-03 rolled back: agreement_drop 0.2 > 0.02")])
    (run,) = LoopRunner(home, Wiring(lambda c: (True, ""), after)).tick()
    assert run.state is RunState.ROLLED_BACK and "canary st-03" in run.reason
    assert after.started == [] and len(jobs) == 1  # nothing was done twice


def test_a_runner_killed_before_storing_the_rollout_id_adopts_the_rollout(
    tmp_path: Path, jobs: list[str]
) -> None:
    home = _home(tmp_path)
    _label(home, 5)
    store = Store(home.db_path)
    run_store.save_policy(store, LoopPolicy(model="inspect", job=JOB, min_new_labels=5))
    store.close()

    class DiesAfterStart(FakeRollout):
        def start(self, candidate: str, policy: LoopPolicy) -> str:
            super().start(candidate, policy)
            raise KeyboardInterrupt  # killed after the rollout began, before its id was stored

    first = DiesAfterStart([])
    with pytest.raises(KeyboardInterrupt):
        LoopRunner(home, Wiring(lambda c: (True, ""), first)).tick()
    after = FakeRollout([(True, "")])
    after.started = list(first.started)  # the manager's store still has that rollout
    (run,) = LoopRunner(home, Wiring(lambda c: (True, ""), after)).tick()
    assert run.state is RunState.COMPLETED and run.rollout_id == "ro-1"
    assert after.started == ["inspect:2"]  # adopted, not started a second time

"""Loop policies and runs in the manager's store; what a policy observes."""

from pathlib import Path

import pytest

from fedge.edge_manager.store import Store
from fedge.loop import run_store
from fedge.loop.pipeline import Published, RunState, advance
from fedge.loop.policy import LoopPolicy, LoopPolicyError, alert_kinds, job_for

JOB = """# the operator's comment stays
[job]
name = "nightly"
rounds = 2

[task]
model = "inspect:1"   # replaced
lr = 0.003

[federation]
backend = "fleet"
"""


def test_the_job_starts_from_the_serving_model_and_keeps_the_rest() -> None:
    text = job_for(JOB, "inspect:7")
    assert 'model = "inspect:7"' in text and "inspect:1" not in text
    assert "# the operator's comment stays" in text and "lr = 0.003" in text
    with pytest.raises(LoopPolicyError, match=r"\[task\] table"):
        job_for('[job]\nname = "x"\n', "inspect:7")
    with pytest.raises(LoopPolicyError, match="not TOML"):
        job_for("[task\nmodel=", "inspect:7")


def test_policies_round_trip_through_the_store(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.db")
    policy = LoopPolicy(
        model="inspect", job=JOB, on_alerts=alert_kinds(["drift"]), canary=("st-03",)
    )
    run_store.save_policy(store, policy)
    assert run_store.policy(store, "inspect") == policy
    run_store.save_policy(store, LoopPolicy(model="inspect", job=JOB, enabled=False))
    assert [p.enabled for p in run_store.policies(store)] == [False]
    assert run_store.policy(store, "other") is None


def _label(store: Store, at: float, origin: str = "operator", model: str = "inspect:3") -> None:
    """A prediction of ``model`` and its label."""
    prediction = f"p{at}{origin}"
    store.conn.execute(
        "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
        "threshold, config_version, latency_ms, source) VALUES (?,?,0,?,?,'{}','accept',0.5,1,"
        "1.0,'')",
        (prediction, "st-01", at, model),
    )
    store.conn.execute(
        "INSERT INTO labels VALUES (?,?,?,?,?,?,?)",
        (f"l{at}{origin}", prediction, "st-01", "scratch", "op", at, origin),
    )


def _alert(store: Store, edge: str, kind: str, model: str, at: float) -> None:
    store.conn.execute(
        "INSERT INTO alerts VALUES (?,?,?,?,?,?,?,?,NULL)",
        (f"a-{edge}-{kind}-{at}", edge, model, kind, 0.4, 0.25, "{}", at),
    )


def test_observe_counts_labels_and_alerts_since_the_last_run(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.db")
    for at in (10.0, 20.0, 30.0):
        _label(store, at)
    _label(store, 40.0, origin="edge")  # given on the station's screen: counts too
    _label(store, 45.0, model="inspect_x:1")  # another model's prediction: does not count
    _alert(store, "st-02", "input_drift", "inspect:3", 25.0)
    _alert(store, "st-03", "input_drift", "other:1", 25.0)  # another model's edge
    _alert(store, "st-01", "input_drift", "inspectXY:1", 25.0)  # "inspect" is no prefix
    seen = run_store.observe(store, "inspect")
    assert (seen.new_labels, seen.running, seen.last_started_at) == (4, False, None)
    assert seen.open_alerts == (("st-02", "input_drift"),)

    run = run_store.new_run("inspect", "3 new labels", now=22.0)
    run_store.save_run(store, run, "triggered", "3 new labels")
    seen = run_store.observe(store, "inspect")
    assert (seen.new_labels, seen.running, seen.last_started_at) == (2, True, 22.0)
    assert seen.open_alerts == (("st-02", "input_drift"),)

    moved = advance(run, Published("inspect:4"), 50.0)
    run_store.save_run(store, moved, "published", "inspect:4")
    assert run_store.unfinished(store) == [moved]
    assert [e["step"] for e in run_store.events(store, run.run_id)] == ["triggered", "published"]
    assert run_store.runs(store, "inspect")[0].state is RunState.GATING

"""Drift references that follow the model (issue 28 item 5), on an in-memory SQLite store.

A station's line changed condition (a brighter lamp: mean brightness 0.45 -> 0.75); the
fleet retrained on it (``inspect:2``) and the gate evaluated the new model on the
station's held-out set, which holds both conditions. Predictions and their batches are
written as ingest writes them (the batch's receive time is the manager's clock), deploy
events as an agent's reports are stored.
"""

import json
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.tick import Monitor, policy_from
from fedge.edge_manager.store import Store
from fedge.loop import run_store
from fedge.loop.pipeline import RunState
from fedge.loop.policy import LoopPolicy, decide

FLEET = "plant-a"
EDGE = "st-02"
OLD, NEW = "inspect:1", "inspect:2"
WINDOW = 100
OLD_LAMP, NEW_LAMP, DIM_LAMP = 0.45, 0.75, 0.2


class Line:
    """One station's records as the manager stores them, in order."""

    def __init__(self, store: Store, seed: int = 0) -> None:
        self.store = store
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def _stats(self, brightness: float) -> str:
        mean = float(self.rng.normal(brightness, 0.03))
        std = float(self.rng.normal(0.2, 0.02))
        return json.dumps(
            {"mean": mean, "std": std, "p05": mean - 1.6 * std, "p95": mean + 1.6 * std}
        )

    def _scores(self) -> str:
        top = float(self.rng.uniform(0.85, 0.99))
        return json.dumps({"clean": top, "scratch": 1 - top})

    def shoot(self, count: int, model: str, brightness: float, received_at: float) -> None:
        """``count`` predictions in one batch the manager received at ``received_at``."""
        self.n += 1
        seq = self.n
        rows = [
            (f"p-{seq}-{i}", EDGE, seq, received_at, model, self._scores(), "accept", 0.5, 1)
            for i in range(count)
        ]
        self.store.conn.executemany(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
            "threshold, config_version, latency_ms, source, stats) "
            "VALUES (?,?,?,?,?,?,?,?,?,1.0,'',?)",
            [(*r, self._stats(brightness)) for r in rows],
        )
        self.store.conn.execute(
            "INSERT INTO batches (edge, stream, seq, session, n_records, received_at) "
            "VALUES (?, 'predictions', ?, 1, ?, ?)",
            (EDGE, seq, count, received_at),
        )

    def evaluate(self, model: str, per_lamp: int) -> None:
        """The gate's held-out rows at the station: both conditions, as they are."""
        rows = [
            (f"h-{lamp}-{i}", model, self._scores(), self._stats(lamp))
            for lamp in (OLD_LAMP, NEW_LAMP)
            for i in range(per_lamp)
        ]
        self.store.conn.executemany(
            "INSERT INTO evaluations (eval_id, edge, prediction_id, model, label, scores, "
            "stats, at, augmented) VALUES ('e-1', ?, ?, ?, 'clean', ?, ?, 50.0, 0)",
            [(EDGE, *r) for r in rows],
        )

    def report(self, deployment: str, model: str, stage: str, at: float, reason: str = "") -> None:
        """A deploy status as ingest stores it, with its deployment's row."""
        name, version = model.split(":")
        self.store.conn.execute(
            "INSERT OR IGNORE INTO deployments (deployment_id, model_name, model_version, "
            "edges, created_at) VALUES (?,?,?,?,?)",
            (deployment, name, int(version), json.dumps([EDGE]), at),
        )
        self.store.conn.execute(
            "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
            "VALUES (?,?,?,?,?,?)",
            (EDGE, deployment, stage, reason, model, at),
        )
        self.store.conn.execute("UPDATE edges SET serving=? WHERE edge=?", (model, EDGE))


@pytest.fixture
def store() -> Iterator[Store]:
    store = Store(":memory:")
    store.conn.execute(
        "INSERT INTO edges (edge, enrolled_at, token_sha256, serving) VALUES (?, 0, 'x', ?)",
        (EDGE, OLD),
    )
    yield store
    store.close()


def _kinds(store: Store, model: str = NEW) -> list[str]:
    return sorted(v.kind for v in alert_store.list_alerts(store) if v.model == model)


def _probation(store: Store, line: Line, *, recorded: bool) -> Monitor:
    """``inspect:2`` deployed to the station after its lamp changed: on probation from
    t=1000 (with ``recorded``, else served without a recorded deployment), one window of
    the new condition scored on probation and judged at t=1060."""
    line.evaluate(NEW, WINDOW)  # the gate's held-out set: half old lamp, half new
    monitor = Monitor(store, FLEET, policy_from(WINDOW, 0.5))
    if recorded:
        line.report("d-2", NEW, "active", 1000.0, "on probation")
    else:
        store.conn.execute("UPDATE edges SET serving=? WHERE edge=?", (NEW, EDGE))
    line.shoot(WINDOW, NEW, NEW_LAMP, 1050.0)
    monitor.tick(1060.0)
    return monitor


def _settles(store: Store, line: Line, monitor: Monitor, *, recorded: bool) -> None:
    """Its probation passes at t=1100; three windows of the new condition follow."""
    if recorded:
        line.report("d-2", NEW, "passed", 1100.0)
    for k in range(3):
        line.shoot(WINDOW, NEW, NEW_LAMP, 1110.0 + 10 * k)
        monitor.tick(1115.0 + 10 * k)


def _retrained(store: Store, line: Line, *, recorded: bool) -> Monitor:
    monitor = _probation(store, line, recorded=recorded)
    _settles(store, line, monitor, recorded=recorded)
    return monitor


def test_the_gates_mixed_held_out_set_keeps_drift_open_against_the_new_condition(
    store: Store,
) -> None:
    # The behaviour the re-basing replaces, where no deployment of the model is known.
    line = Line(store, seed=1)
    _retrained(store, line, recorded=False)
    assert "input_drift" in _kinds(store)
    detail = next(v.detail for v in alert_store.list_alerts(store) if v.kind == "input_drift")
    assert detail["reference"] == "evaluations"


def test_after_its_probation_the_models_proven_window_is_its_reference(
    store: Store,
) -> None:
    line = Line(store, seed=1)
    monitor = _probation(store, line, recorded=True)
    # On probation, drift is judged as before (a rollout's `alerts` criterion reads it).
    assert _kinds(store) == ["input_drift"]
    _settles(store, line, monitor, recorded=True)
    # Re-based on the window its probation proved it on, the alert cleared at once.
    assert _kinds(store) == []
    (view,) = alert_store.list_alerts(store, include_cleared=True)
    assert (view.kind, view.raised_at, view.cleared_at, view.cleared_by) == (
        "input_drift",
        1060.0,
        1115.0,
        "monitor",
    )
    stored = store.one("SELECT first_rowid, rows FROM drift_references WHERE edge=?", (EDGE,))
    assert stored is not None
    kept = json.loads(stored["rows"])
    assert (kept["settled_after"], kept["deployment"], len(kept["rows"])) == (
        1100.0,
        "d-2",
        WINDOW,
    )
    assert stored["first_rowid"] == 1  # the deployment's first prediction

    # A real change after it settled (the lamp dims) is still seen, against that window.
    line.shoot(WINDOW, NEW, DIM_LAMP, 1200.0)
    (raised,) = monitor.tick(1205.0)
    assert raised.condition.value == "input_drift"
    assert json.loads(raised.detail)["reference"] == "settled"

    # A restarted monitor reads the same reference back (and raises nothing twice).
    restarted = Monitor(store, FLEET, policy_from(WINDOW, 0.5))
    line.shoot(10, NEW, DIM_LAMP, 1210.0)
    assert restarted.tick(1215.0) == []
    assert _kinds(store) == ["input_drift"]


def test_a_new_deployment_of_the_model_re_bases_its_reference(store: Store) -> None:
    line = Line(store, seed=2)
    monitor = _retrained(store, line, recorded=True)
    # Redeployed (say after a local rollback) once the line runs dim: the dim lamp drifts
    # from the bright window of before while on probation, and settles it after the pass.
    line.report("d-3", NEW, "active", 1300.0, "on probation")
    line.shoot(WINDOW, NEW, DIM_LAMP, 1310.0)
    (raised,) = monitor.tick(1315.0)
    assert json.loads(raised.detail)["reference"] == "settled"
    line.report("d-3", NEW, "passed", 1400.0)
    line.shoot(WINDOW, NEW, DIM_LAMP, 1410.0)
    (cleared,) = monitor.tick(1415.0)
    assert (cleared.alert_id, cleared.state.value) == (raised.alert_id, "cleared")
    kept = json.loads(store.scalar("SELECT rows FROM drift_references WHERE edge=?", (EDGE,)))
    assert (kept["settled_after"], kept["deployment"]) == (1400.0, "d-3")


def test_a_drift_triggered_loop_does_not_retrain_on_its_own_models_alerts(
    store: Store,
) -> None:
    # `fedge loop enable inspect --or-on-alert drift --cooldown 0`, as the demo runs it;
    # its run started at t=900 trained inspect:2 on the new condition and rolled it out.
    policy = LoopPolicy(
        model="inspect", job="[task]\nmodel = 'inspect'\n", min_new_labels=0,
        on_alerts=frozenset({"input_drift", "score_drift"}), cooldown_s=0.0,
    )  # fmt: skip
    run = run_store.new_run("inspect", "alert: input_drift at st-02", 900.0)
    run_store.save_run(store, run, "started", "")
    line = Line(store, seed=3)
    monitor = _probation(store, line, recorded=True)
    # Raised on probation against the gate's mixed held-out set: the rollout's business.
    assert run_store.observe(store, "inspect").open_alerts == ((EDGE, "input_drift"),)

    # The rollout completes once the station passed; the alert is still open until the
    # monitor's next tick, and the ended run no longer holds the loop back.
    line.report("d-2", NEW, "passed", 1100.0)
    run_store.save_run(store, replace(run, state=RunState.COMPLETED, updated_at=1100.0), "done", "")
    seen = run_store.observe(store, "inspect")
    assert _kinds(store) == ["input_drift"]
    decision = decide(policy, seen, 1101.0)
    assert (seen.open_alerts, decision.start) == ((), False)
    assert decision.reason == "no triggering alert"

    # With the new model serving the condition it was trained for, nothing opens again.
    _settles(store, line, monitor, recorded=False)
    assert _kinds(store) == []
    assert not decide(policy, run_store.observe(store, "inspect"), 5000.0).start

    # A real change after the model settled still starts the next run.
    line.shoot(WINDOW, NEW, DIM_LAMP, 1200.0)
    monitor.tick(1205.0)
    seen = run_store.observe(store, "inspect")
    decision = decide(policy, seen, 5000.0)
    assert seen.open_alerts == ((EDGE, "input_drift"),)
    assert decision.start and decision.reason == "alert: input_drift at st-02"

"""A staged rollout carrying an anomaly model beside the classifier (issue 28): the plan
stores it, the machine moves and aborts the pair as it does a classifier, the config
moves and restores the anomaly threshold with it, the pair's health counts only the new
pair's predictions, and a ref that is no anomaly model is refused. Pure, or a real
SQLite store; no processes."""

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.edge_manager.registry.pairs import anomaly_problem
from fedge.edge_manager.rollout import health, machine
from fedge.edge_manager.rollout.health import MIN_NOVEL_IMAGES
from fedge.edge_manager.rollout.machine import EdgeHealth, EventKind, Rollout, RolloutState
from fedge.edge_manager.rollout.plan import RolloutError, RolloutPlan, make_plan
from fedge.edge_manager.rollout.thresholds import moved_config, restored_config
from fedge.edge_manager.store import Store
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import ModelManifest, Preprocess, TensorSpec

EDGES = ["st-01", "st-02", "st-03"]
MOVED_AT = 1000.0


def test_the_plan_stores_the_anomaly_model_and_old_plans_carry_none() -> None:
    plan = make_plan(EDGES, anomaly=" inspect-anomaly:2 ", abort_if="novel_rate>0.2")
    assert plan.anomaly == "inspect-anomaly:2"
    stored = plan.to_json_dict()
    assert stored["anomaly"] == "inspect-anomaly:2"
    assert RolloutPlan.from_json_dict(stored) == plan
    # A plan without one stores no key, so older managers read it as they did.
    plain = make_plan(EDGES)
    assert plain.anomaly is None and "anomaly" not in plain.to_json_dict()
    assert RolloutPlan.from_json_dict(plain.to_json_dict()).anomaly is None


@pytest.mark.parametrize("ref", ["inspect-anomaly", "inspect-anomaly:x", ":2", "a b:1", ""])
def test_a_malformed_anomaly_ref_is_refused(ref: str) -> None:
    with pytest.raises(RolloutError, match="must look like NAME:VERSION"):
        make_plan(EDGES, anomaly=ref)


def test_a_stored_plan_with_a_damaged_anomaly_is_refused() -> None:
    stored = make_plan(EDGES).to_json_dict()
    with pytest.raises(RolloutError, match="damaged"):
        RolloutPlan.from_json_dict({**stored, "anomaly": 3})


def test_the_pair_moves_canary_first_and_a_novel_rate_sends_it_back() -> None:
    plan = make_plan(
        EDGES,
        canary=["st-02"],
        health_window="2s",
        abort_if="novel_rate>0.2",
        anomaly="inspect-anomaly:2",
    )
    rollout = Rollout(
        "r-1", "inspect:1", plan, RolloutState.PENDING, -1, machine.initial_edges(plan)
    )
    first = machine.step(rollout, {}, 100.0)
    assert first.move == ("st-02",)
    assert [e.detail for e in first.events if e.kind is EventKind.MOVED] == [
        "to inspect:1 with anomaly model inspect-anomaly:2"
    ]
    assert first.events[0].detail == "rolling out inspect:1 with anomaly model inspect-anomaly:2"
    rollout = machine.apply(rollout, first, 100.0)
    judged = {"st-02": EdgeHealth(settled_at=101.0, metrics={"novel_rate": 0.5})}
    bad = machine.step(rollout, judged, 101.5)
    assert bad.state is RolloutState.ABORTED and bad.roll_back == ("st-02",) and not bad.move
    assert bad.reason == "st-02: novel_rate=0.5 > 0.2"


def test_the_anomaly_threshold_moves_with_the_pair_and_comes_back() -> None:
    current = EdgeConfig(
        "plant-a",
        "st-02",
        4,
        default_threshold=0.7,
        model="inspect:1",
        anomaly_threshold=12.0,
        anomaly_threshold_model="inspect-anomaly:1",
    )
    moved = moved_config(
        current,
        fleet="plant-a",
        edge="st-02",
        model="inspect:1",
        recommended=None,
        now=5.0,
        anomaly="inspect-anomaly:2",
        anomaly_threshold=3.5,
    )
    assert (moved.anomaly_threshold, moved.anomaly_threshold_model) == (3.5, "inspect-anomaly:2")
    assert moved.default_threshold == 0.7
    # No threshold of the station's own for the new model: the old one stays, tied to the
    # old model, so the new model calls nothing novel until an operator sets one.
    unset = moved_config(
        current,
        fleet="plant-a",
        edge="st-02",
        model="inspect:1",
        recommended=None,
        now=5.0,
        anomaly="inspect-anomaly:2",
    )
    assert unset.anomaly_threshold_for("inspect-anomaly:2") is None
    back = restored_config(
        moved, current, fleet="plant-a", edge="st-02", previous_model="inspect:1", now=6.0
    )
    assert (back.version, back.anomaly_threshold, back.anomaly_threshold_model) == (
        6,
        12.0,
        "inspect-anomaly:1",
    )
    # An edge that had no anomaly threshold has none again.
    fresh = restored_config(
        moved, None, fleet="plant-a", edge="st-02", previous_model="inspect:1", now=6.0
    )
    assert (fresh.anomaly_threshold, fresh.anomaly_threshold_model) == (None, None)


def _manifest(
    name: str, output: tuple[int | str, ...], size: int = 32, prepared: bool = False
) -> ModelManifest:
    return ModelManifest(
        name=name,
        version=1,
        sha256="0" * 64,
        size=1,
        inputs=(TensorSpec("image", "float32", ("batch", 1, size, size)),),
        outputs=(TensorSpec("out", "float32", output),),
        classes=("good", "anomalous") if len(output) == 1 else ("clean", "scratch"),
        preprocess=Preprocess(size) if prepared else None,
    )


def test_only_an_anomaly_model_for_the_classifiers_images_may_serve_beside_it() -> None:
    classifier = _manifest("inspect", ("batch", 2))
    assert anomaly_problem(classifier, _manifest("inspect-anomaly", ("batch",))) is None
    other_classifier = _manifest("other", ("batch", 2))
    assert "not an anomaly model" in str(anomaly_problem(classifier, other_classifier))
    assert "the classifier itself" in str(anomaly_problem(classifier, classifier))
    bigger = _manifest("inspect-anomaly", ("batch",), size=64)
    assert "takes ['batch', 1, 64, 64] images" in str(anomaly_problem(classifier, bigger))
    prepared = _manifest("inspect-anomaly", ("batch",), prepared=True)
    assert "prepared as" in str(anomaly_problem(classifier, prepared))
    # A direct deployment checks the kind only; the stations check the images.
    assert anomaly_problem(classifier, bigger, images=False) is None


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    store = Store(tmp_path / "manager.db")
    try:
        yield store.conn
    finally:
        store.close()


def _predictions(
    conn: sqlite3.Connection, seq: int, anomaly_model: str, novel: list[int], latency: float
) -> None:
    conn.execute(
        "INSERT INTO batches (edge, stream, seq, session, n_records, received_at) "
        "VALUES ('st-02', 'predictions', ?, 1, ?, ?)",
        (seq, len(novel), MOVED_AT + seq),
    )
    conn.executemany(
        "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
        "threshold, config_version, latency_ms, source, anomaly_model, anomaly_score, novel) "
        "VALUES (?, 'st-02', ?, 0, 'inspect:1', '{}', 'accept', 0.5, 1, ?, 'test', ?, 1.0, ?)",
        [(f"p-{seq}-{i}", seq, latency, anomaly_model, n) for i, n in enumerate(novel)],
    )


def test_the_pairs_health_counts_only_the_new_pairs_predictions(conn: sqlite3.Connection) -> None:
    # The old pair's parts, received after the move (in flight at the swap): none novel.
    _predictions(conn, 1, "inspect-anomaly:1", [0] * MIN_NOVEL_IMAGES, latency=1.0)
    # The new pair's: half novel, slower.
    _predictions(conn, 2, "inspect-anomaly:2", [1, 0] * (MIN_NOVEL_IMAGES // 2), latency=9.0)
    novel = health.novel_rate(conn, "st-02", "inspect:1", MOVED_AT, "inspect-anomaly:2")
    assert novel == 0.5
    # Without the pair, the old pair's parts dilute it (what a classifier-only read sees).
    assert health.novel_rate(conn, "st-02", "inspect:1", MOVED_AT) == 0.25
    p95 = health.latency_p95_ms(conn, "st-02", "inspect:1", MOVED_AT, "inspect-anomaly:2")
    assert p95 == 9.0


def test_an_edge_sent_back_to_its_pair_is_back_once_the_restoring_deployment_is_active(
    conn: sqlite3.Connection,
) -> None:
    assert not health.restore_active(conn, "st-02", "d-back")
    conn.execute(
        "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
        "VALUES ('st-02', 'd-back', 'downloading', '', 'inspect:1', 5.0)"
    )
    assert not health.restore_active(conn, "st-02", "d-back")
    conn.execute(
        "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
        "VALUES ('st-02', 'd-back', 'active', '', 'inspect:1', 6.0)"
    )
    assert health.restore_active(conn, "st-02", "d-back")

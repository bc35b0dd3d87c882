"""The monitor's windows, estimates and alert lifecycle on an in-memory SQLite store.

Predictions and evaluations are written as ingest and the gate write them; the images
behind them are simulated by their statistics: in-distribution images have a mean
brightness around 0.45, "shifted" ones (a brighter lamp) around 0.75.
"""

import json
from collections.abc import Iterator

import numpy as np
import pytest

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.rules import (
    Clear,
    Estimate,
    Finding,
    OpenAlert,
    Raise,
    Rearm,
    WindowRow,
    accuracy_finding,
    estimate,
    transitions,
)
from fedge.edge_manager.monitor.tick import Monitor, policy_from
from fedge.edge_manager.store import Store
from fedge.protocols import codec
from fedge.protocols.alerts import Alert, AlertKind, AlertState

FLEET = "plant-a"
EDGE = "st-01"
MODEL = "inspect:1"
WINDOW = 100


@pytest.fixture
def store() -> Iterator[Store]:
    store = Store(":memory:")
    for edge in (EDGE, "st-02"):
        store.conn.execute(
            "INSERT INTO edges (edge, enrolled_at, token_sha256, serving) VALUES (?, 0, 'x', ?)",
            (edge, MODEL),
        )
    yield store
    store.close()


@pytest.fixture
def monitor(store: Store) -> Monitor:
    return Monitor(store, FLEET, policy_from(WINDOW, 0.8))


class Camera:
    """Writes predictions of simulated images, in order, with increasing times."""

    def __init__(self, store: Store, seed: int = 0) -> None:
        self.store = store
        self.rng = np.random.default_rng(seed)
        self.n = 0
        self.labels: dict[str, str] = {}  # held-out image -> its label at the manager

    def stats(self, brightness: float) -> dict[str, float]:
        mean = float(self.rng.normal(brightness, 0.03))
        std = float(self.rng.normal(0.2, 0.02))
        return {
            "mean": mean,
            "std": std,
            "p05": mean - 1.6 * std,
            "p95": mean + 1.6 * std,
            "edges": float(self.rng.normal(0.1, 0.01)),
        }

    def scores(self, confident: bool) -> dict[str, float]:
        top = float(self.rng.uniform(0.85, 0.99) if confident else self.rng.uniform(0.5, 0.6))
        clean_first = self.rng.random() < 0.7
        return (
            {"clean": top, "scratch": 1 - top}
            if clean_first
            else {
                "clean": 1 - top,
                "scratch": top,
            }
        )

    def shoot(
        self,
        count: int,
        *,
        brightness: float = 0.45,
        confident: bool = True,
        edge: str = EDGE,
        model: str = MODEL,
        with_stats: bool = True,
    ) -> None:
        rows = []
        for _ in range(count):
            self.n += 1
            stats = json.dumps(self.stats(brightness)) if with_stats else ""
            rows.append(
                (
                    f"p-{self.n}",
                    edge,
                    self.n,
                    1000.0 + self.n,
                    model,
                    json.dumps(self.scores(confident)),
                    "accept",
                    0.5,
                    1,
                    1.0,
                    "",
                    stats,
                )
            )
        self.store.conn.executemany(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
            "threshold, config_version, latency_ms, source, stats) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )

    def evaluate(
        self,
        count: int,
        *,
        edge: str = EDGE,
        model: str = MODEL,
        brightness: float = 0.45,
        wrong_every: int = 10,
        augmented: int = 0,
    ) -> None:
        """The gate's evaluation rows: labelled held-out images, right 90% of the time
        (by default), stored as ``edge_manager.evaluations`` stores them -- a re-lit copy
        (``augmented`` k) under ``<id>~k`` -- and the images' labels at the manager (a
        copy's label is its image's)."""
        rows, labels = [], []
        for i in range(count):
            base = f"h-{edge}-{i}"
            if augmented:
                label = self.labels[base]
            else:
                label = "clean" if self.rng.random() < 0.7 else "scratch"
                self.labels[base] = label
                labels.append((f"l-{base}", base, edge, label, "op", 800.0, "operator"))
            other = "scratch" if label == "clean" else "clean"
            wrong = i % wrong_every == 0
            confident = augmented or not wrong
            top = float(self.rng.uniform(0.85, 0.99) if confident else self.rng.uniform(0.5, 0.6))
            predicted = other if wrong else label
            scores = {predicted: top, ("scratch" if predicted == "clean" else "clean"): 1 - top}
            rows.append(
                (
                    "e-1",
                    edge,
                    base + (f"~{augmented}" if augmented else ""),
                    model,
                    label,
                    json.dumps(scores),
                    json.dumps(self.stats(brightness)),
                    900.0,
                    augmented,
                )
            )
        self.store.conn.executemany(
            "INSERT INTO evaluations (eval_id, edge, prediction_id, model, label, scores, stats, "
            "at, augmented) VALUES (?,?,?,?,?,?,?,?,?)",
            rows,
        )
        self.store.conn.executemany(
            "INSERT INTO labels (label_id, prediction_id, edge, label, who, at, origin) "
            "VALUES (?,?,?,?,?,?,?)",
            labels,
        )


def _open(store: Store) -> list[tuple[str, str, str]]:
    return [(v.edge, v.model, v.kind) for v in alert_store.list_alerts(store)]


# ---------------------------------------------------------------- windows and drift


def test_in_distribution_raises_nothing_and_records_an_estimate(
    store: Store, monitor: Monitor
) -> None:
    camera = Camera(store)
    camera.shoot(WINDOW - 1)
    assert monitor.tick(2000.0) == []
    assert store.scalar("SELECT count(*) FROM estimates") == 0  # not a full window yet
    camera.shoot(WINDOW + 1)
    assert monitor.tick(2001.0) == []
    assert _open(store) == []
    (row,) = alert_store.list_estimates(store)
    assert (row.edge, row.model, row.n, row.labelled) == (EDGE, MODEL, WINDOW, 0)
    assert row.mpp is None and row.true_accuracy is None  # no gate evaluation yet
    assert row.calibration is not None and 0.85 <= row.calibration <= 0.99
    assert (row.window_start, row.window_end) == (1101.0, 1200.0)


def test_brighter_images_raise_one_input_drift_alert_until_they_stop(
    store: Store, monitor: Monitor
) -> None:
    camera = Camera(store, seed=1)
    camera.shoot(WINDOW)
    camera.shoot(WINDOW, brightness=0.75)
    (raised,) = monitor.tick(2000.0)
    assert (raised.condition, raised.state, raised.edge, raised.model) == (
        AlertKind.INPUT_DRIFT,
        AlertState.RAISED,
        EDGE,
        MODEL,
    )
    detail = json.loads(raised.detail)
    assert "mean" in detail["drifted"] and detail["reference"] == "predictions"
    mean = next(f for f in detail["features"] if f["feature"] == "mean")
    assert mean["psi"] >= 0.25 and mean["p_value"] < 1e-3
    assert raised.value >= raised.threshold == 0.25
    assert codec.decode(codec.encode(raised), Alert) == raised

    # Still drifted: the open alert is not raised again, with or without new data.
    assert monitor.tick(2010.0) == []
    camera.shoot(10, brightness=0.75)
    assert monitor.tick(2020.0) == []
    assert _open(store) == [(EDGE, MODEL, "input_drift")]

    # The lamp is fixed: a window of normal images clears it.
    camera.shoot(WINDOW)
    (cleared,) = monitor.tick(2030.0)
    assert (cleared.alert_id, cleared.state, cleared.cleared_by) == (
        raised.alert_id,
        AlertState.CLEARED,
        "monitor",
    )
    assert cleared.cleared_at == 2030.0
    assert _open(store) == []
    (view,) = alert_store.list_alerts(store, include_cleared=True)
    assert (view.cleared_at, view.cleared_by) == (2030.0, "monitor")
    # Judged on a sliding window, estimates recorded for windows that do not overlap.
    windows = [(r.window_start, r.window_end) for r in alert_store.list_estimates(store)]
    assert windows == [(1211.0, 1310.0), (1101.0, 1200.0)]


def test_the_gates_evaluation_is_the_reference_and_trains_the_mpp_predictor(
    store: Store, monitor: Monitor
) -> None:
    camera = Camera(store, seed=2)
    camera.evaluate(WINDOW)
    camera.shoot(WINDOW, brightness=0.75)  # drifted from the very first window
    events = monitor.tick(2000.0)
    assert [e.condition for e in events] == [AlertKind.INPUT_DRIFT]
    assert json.loads(events[0].detail)["reference"] == "evaluations"
    stored = store.one("SELECT n_rows, accuracy FROM mpp_models WHERE model=?", (MODEL,))
    assert stored == {"n_rows": WINDOW, "accuracy": 0.9}
    (row,) = alert_store.list_estimates(store)
    assert row.mpp is not None and 0.8 < row.mpp <= 1.0


def test_re_lit_copies_train_the_mpp_predictor_but_stay_out_of_the_reference(
    store: Store, monitor: Monitor
) -> None:
    """Stations also score re-lit copies of their held-out images (augmented rows): here
    brighter copies the model gets wrong half the time, with the same confident scores.
    The MPP fit learns from them that bright images are often wrong, so a bright window
    is estimated low; the drift reference is the images as they are, so the bright
    window is still drift (a reference holding the copies would hide it)."""
    camera = Camera(store, seed=6)
    camera.evaluate(WINDOW)
    camera.evaluate(WINDOW, brightness=0.75, wrong_every=2, augmented=1)
    camera.shoot(WINDOW)
    assert monitor.tick(1999.0) == []  # in distribution: no drift against the gate's images
    camera.shoot(WINDOW, brightness=0.75)
    events = monitor.tick(2000.0)
    assert sorted(e.condition for e in events) == sorted(
        [AlertKind.INPUT_DRIFT, AlertKind.ACCURACY_ESTIMATE]
    )
    drift = next(e for e in events if e.condition is AlertKind.INPUT_DRIFT)
    assert json.loads(drift.detail)["reference"] == "evaluations"
    stored = store.one("SELECT n_rows, accuracy FROM mpp_models WHERE model=?", (MODEL,))
    assert stored == {"n_rows": 2 * WINDOW, "accuracy": (90 + 50) / (2 * WINDOW)}
    bright, normal = alert_store.list_estimates(store)  # newest first
    assert normal.mpp is not None and normal.mpp > 0.8
    assert bright.mpp is not None and bright.mpp < 0.65  # the copies' 50%, not the held-out 90%

    # Without the copies the same window is estimated as accurate as the gate set.
    store.conn.execute("DELETE FROM evaluations WHERE augmented > 0")
    store.conn.execute("DELETE FROM estimates")
    store.conn.execute("DELETE FROM mpp_models")
    plain = Monitor(store, FLEET, policy_from(WINDOW, 0.8))
    plain.tick(2001.0)
    (row,) = alert_store.list_estimates(store)
    assert row.window_start == bright.window_start
    assert row.mpp is not None and row.mpp > 0.8


def test_low_estimated_accuracy_raises_an_alert_and_labels_give_the_true_accuracy(
    store: Store, monitor: Monitor
) -> None:
    camera = Camera(store, seed=3)
    camera.evaluate(2 * WINDOW)
    camera.shoot(WINDOW, confident=False)  # unsure scores: MPP expects many errors
    store.conn.executemany(
        "INSERT INTO labels (label_id, prediction_id, edge, label, who, at, origin) "
        "VALUES (?,?,?,?,?,?,?)",
        [(f"l-{i}", f"p-{i}", EDGE, "clean", "op", 1.0, "operator") for i in range(1, 21)],
    )
    events = monitor.tick(2000.0)
    assert AlertKind.ACCURACY_ESTIMATE in [e.condition for e in events]
    (row,) = alert_store.list_estimates(store)
    assert row.mpp is not None and row.mpp < 0.8 and row.labelled == 20
    scores = [
        json.loads(s)
        for (s,) in store.conn.execute(
            "SELECT scores FROM predictions WHERE prediction_id IN "
            f"({','.join(repr(f'p-{i}') for i in range(1, 21))})"
        )
    ]
    right = sum(max(s, key=lambda k: s[k]) == "clean" for s in scores)
    assert row.true_accuracy == pytest.approx(right / 20)


def test_predictions_without_stats_are_not_judged_for_input_drift(
    store: Store, monitor: Monitor
) -> None:
    camera = Camera(store, seed=4)
    camera.shoot(2 * WINDOW, with_stats=False)  # an agent from before image statistics
    assert monitor.tick(2000.0) == []
    assert alert_store.list_estimates(store)[0].n == WINDOW


def test_an_acknowledged_condition_is_not_raised_again_until_it_stopped(
    store: Store, monitor: Monitor
) -> None:
    camera = Camera(store, seed=5)
    camera.shoot(WINDOW)
    camera.shoot(WINDOW, brightness=0.75)
    (raised,) = monitor.tick(2000.0)
    view = alert_store.acknowledge(store, raised.alert_id, "alice", "lamp known", 2001.0)
    assert (view.cleared_at, view.cleared_by, view.note) == (2001.0, "alice", "lamp known")
    with pytest.raises(ManagerError, match="already cleared"):
        alert_store.acknowledge(store, raised.alert_id, "bob", "", 2002.0)
    with pytest.raises(ManagerError, match="no alert 'a-nope'"):
        alert_store.acknowledge(store, "a-nope", "bob", "", 2002.0)

    # serve announces the operator's clearing once; the condition still holds: no alert.
    camera.shoot(5, brightness=0.75)
    (announced,) = monitor.tick(2010.0)
    assert (announced.alert_id, announced.state, announced.cleared_by) == (
        raised.alert_id,
        AlertState.CLEARED,
        "alice",
    )
    camera.shoot(5, brightness=0.75)
    assert monitor.tick(2020.0) == []
    assert _open(store) == []

    # Back to normal (re-armed), then drifted again: a new alert.
    camera.shoot(WINDOW)
    assert monitor.tick(2030.0) == []
    assert store.scalar("SELECT rearmed_at FROM alert_acks") == 2030.0
    camera.shoot(WINDOW, brightness=0.75)
    (again,) = monitor.tick(2040.0)
    assert again.condition is AlertKind.INPUT_DRIFT and again.alert_id != raised.alert_id


def test_alerts_of_a_model_no_longer_served_are_cleared(store: Store, monitor: Monitor) -> None:
    camera = Camera(store, seed=6)
    camera.shoot(WINDOW)
    camera.shoot(WINDOW, brightness=0.75)
    (raised,) = monitor.tick(2000.0)
    store.conn.execute("UPDATE edges SET serving='inspect:2' WHERE edge=?", (EDGE,))
    (cleared,) = monitor.tick(2010.0)
    assert (cleared.alert_id, cleared.state) == (raised.alert_id, AlertState.CLEARED)
    assert _open(store) == []


def test_edges_are_judged_apart(store: Store, monitor: Monitor) -> None:
    camera = Camera(store, seed=7)
    camera.shoot(WINDOW, edge="st-02")
    camera.shoot(WINDOW, edge="st-02", brightness=0.75)
    camera.shoot(2 * WINDOW)
    events = monitor.tick(2000.0)
    assert [(e.edge, e.condition) for e in events] == [("st-02", AlertKind.INPUT_DRIFT)]


def test_a_restarted_monitor_does_not_raise_an_open_alert_twice(
    store: Store, monitor: Monitor
) -> None:
    camera = Camera(store, seed=8)
    camera.shoot(WINDOW)
    camera.shoot(WINDOW, brightness=0.75)
    assert len(monitor.tick(2000.0)) == 1
    restarted = Monitor(store, FLEET, policy_from(WINDOW, 0.8))
    assert restarted.tick(2010.0) == []
    assert store.scalar("SELECT count(*) FROM alerts") == 1


# ---------------------------------------------------------------- the pure core


def _finding(kind: AlertKind, holds: bool | None) -> Finding:
    return Finding(kind, holds, 0.5, 0.25, {})


def test_transitions() -> None:
    drift = AlertKind.INPUT_DRIFT
    opened = {drift: OpenAlert("a-1", drift, 1.0)}
    assert transitions({}, frozenset(), [_finding(drift, True)]) == [Raise(_finding(drift, True))]
    assert transitions(opened, frozenset(), [_finding(drift, True)]) == []
    assert transitions(opened, frozenset(), [_finding(drift, None)]) == []
    assert transitions({}, frozenset(), [_finding(drift, None)]) == []
    assert transitions(opened, frozenset(), [_finding(drift, False)]) == [
        Clear("a-1", drift, _finding(drift, False))
    ]
    assert transitions({}, frozenset({drift}), [_finding(drift, True)]) == []
    assert transitions({}, frozenset({drift}), [_finding(drift, False)]) == [Rearm(drift)]


def test_estimate_and_accuracy_finding() -> None:
    rows = [
        WindowRow({"clean": 0.9, "scratch": 0.1}, None, at=1.0, label="clean"),
        WindowRow({"clean": 0.3, "scratch": 0.7}, None, at=2.0, label="clean"),
        WindowRow({"clean": 0.6, "scratch": 0.4}, None, at=3.0),
    ]
    result = estimate(rows, None)
    assert result.calibration == pytest.approx((0.9 + 0.7 + 0.6) / 3)
    assert result == Estimate(1.0, 3.0, 3, None, result.calibration, 2, 0.5)
    assert accuracy_finding(result, 0.8).holds is None
    low = Estimate(1.0, 3.0, 3, 0.6, 0.7, 0, None)
    finding = accuracy_finding(low, 0.8)
    assert (finding.holds, finding.value, finding.threshold) == (True, 0.6, 0.8)
    assert accuracy_finding(Estimate(1.0, 3.0, 3, 0.85, 0.7, 0, None), 0.8).holds is False


def test_one_edges_bad_rows_do_not_stop_the_others_being_watched(
    store: Store, monitor: Monitor
) -> None:
    camera = Camera(store, seed=9)
    camera.shoot(2 * WINDOW, edge="st-02")
    store.conn.execute("UPDATE predictions SET scores='{\"clean\": \"x\"}' WHERE edge='st-02'")
    camera.shoot(WINDOW)
    camera.shoot(WINDOW, brightness=0.75)
    events = monitor.tick(2000.0)
    assert [(e.edge, e.condition) for e in events] == [(EDGE, AlertKind.INPUT_DRIFT)]
    assert [r.edge for r in alert_store.list_estimates(store)] == [EDGE]


def test_each_window_records_its_rejects_and_drift_for_the_trends(
    store: Store, monitor: Monitor
) -> None:
    camera = Camera(store)
    camera.evaluate(WINDOW)
    camera.shoot(WINDOW)
    store.conn.execute("UPDATE predictions SET decision='reject' WHERE seq % 4 = 0")
    monitor.tick(2000.0)
    camera.shoot(WINDOW, brightness=0.75)
    monitor.tick(2001.0)
    bright, normal = alert_store.list_estimates(store)  # newest first
    assert (normal.rejects, bright.rejects) == (WINDOW // 4, 0)
    # The largest PSI of the window's image statistics: sampling noise in distribution
    # (about 0.3 here, under the drift test's KS half), far above it under a brighter lamp.
    assert normal.input_drift is not None and bright.input_drift is not None
    assert bright.input_drift > 10 * normal.input_drift
    assert normal.score_drift is not None and bright.score_drift is not None

"""The monitor under review findings: bounded ticks, hysteresis, the MPP fit's labels, a
corrupt stored predictor, alerts that cannot be announced, a persisted drift reference.

In-memory SQLite and the simulated camera of ``test_monitor``.
"""

import json
import re
import sqlite3
from collections.abc import Iterator

import pytest

from fedge.edge_manager.labels import current as labels
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.alert_store import AlertView
from fedge.edge_manager.monitor.rules import (
    Clear,
    Estimate,
    Finding,
    OpenAlert,
    Raise,
    accuracy_finding,
    transitions,
    with_off_delay,
)
from fedge.edge_manager.monitor.tick import Monitor, policy_from
from fedge.edge_manager.store import Store
from fedge.protocols.alerts import Alert, AlertKind, AlertState
from fedge.protocols.errors import ValidationError

from .test_tick import EDGE, FLEET, MODEL, WINDOW, Camera


@pytest.fixture
def store() -> Iterator[Store]:
    store = Store(":memory:")
    store.conn.execute(
        "INSERT INTO edges (edge, enrolled_at, token_sha256, serving) VALUES (?, 0, 'x', ?)",
        (EDGE, MODEL),
    )
    yield store
    store.close()


def _monitor(store: Store) -> Monitor:
    return Monitor(store, FLEET, policy_from(WINDOW, 0.8))


# ---------------------------------------------------------------- 1. bounded ticks

_BIG_TABLES = {"predictions", "evaluations", "alerts", "alert_acks", "labels", "estimates"}


def _grown_store(history: int) -> Store:
    """An edge with a long history of an older model, now serving MODEL with fewer than
    a window of predictions; many cleared (and announced) alerts; a gate evaluation."""
    store = Store(":memory:")
    store.conn.execute(
        "INSERT INTO edges (edge, enrolled_at, token_sha256, serving) VALUES (?, 0, 'x', ?)",
        (EDGE, MODEL),
    )
    camera = Camera(store, seed=11)
    camera.shoot(history, model="inspect:0")
    camera.shoot(WINDOW // 2)
    camera.evaluate(WINDOW, model="inspect:0")
    store.conn.executemany(
        "INSERT INTO alerts (alert_id, edge, model, kind, value, threshold, detail, "
        "raised_at, cleared_at) VALUES (?,?,?,?,?,?,?,?,?)",
        [
            (f"a-{i}", EDGE, "inspect:0", "input_drift", 1.0, 0.25, "{}", i, i + 1)
            for i in range(history // 4)
        ],
    )
    store.conn.executemany(
        "INSERT INTO alert_acks (alert_id, edge, model, kind, who, note, at, rearmed_at, "
        "published_at) VALUES (?,?,?,?,?,?,?,?,?)",
        [
            (f"a-{i}", EDGE, "inspect:0", "input_drift", "op", "", i, i, i)
            for i in range(0, history // 4, 2)
        ],
    )
    return store


def _instructions(store: Store, monitor: Monitor, now: float) -> int:
    """SQLite VM instructions (in thousands) one tick executes: work, not time."""
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    store.conn.set_progress_handler(count, 1000)
    try:
        monitor.tick(now)
    finally:
        store.conn.set_progress_handler(None, 0)
    return steps[0]


def test_a_tick_does_not_grow_with_the_history_of_the_edge() -> None:
    work = []
    for history in (2_000, 20_000):
        store = _grown_store(history)
        monitor = _monitor(store)
        monitor.tick(1.0)
        Camera(store, seed=12).shoot(1)  # something new: the pair is read again
        store.conn.execute("UPDATE predictions SET prediction_id = 'q-' || rowid")
        work.append(_instructions(store, monitor, 2.0))
        store.close()
    small, large = work
    assert large <= 1.5 * small + 20, work  # 10x the history, about the same work


def test_every_query_of_a_tick_uses_an_index() -> None:
    store = _grown_store(2_000)
    camera = Camera(store, seed=13)
    camera.shoot(2 * WINDOW, brightness=0.75)  # a full window: the whole tick runs
    statements: list[str] = []
    store.conn.set_trace_callback(statements.append)
    try:
        _monitor(store).tick(3.0)
    finally:
        store.conn.set_trace_callback(None)
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) >= 8
    scans = []
    for sql in selects:
        for row in store.conn.execute("EXPLAIN QUERY PLAN " + sql):
            detail = str(row[3])
            match = re.match(r"SCAN (\w+)", detail)
            if match and "INDEX" not in detail:
                name = match.group(1)
                if name in _BIG_TABLES or name in {"p", "e", "a", "k", "l"}:
                    scans.append((detail, sql))
    assert scans == []
    store.close()


# ---------------------------------------------------------------- 2. hysteresis


def _simulate(findings: list[Finding], window: int = WINDOW) -> list[str]:
    """Run findings through transitions as the monitor does; what happened, in order."""
    opened: dict[AlertKind, OpenAlert] = {}
    events = []
    for n, finding in enumerate(findings):
        for action in transitions(opened, frozenset(), [finding]):
            if isinstance(action, Raise):
                opened[finding.kind] = OpenAlert(f"a-{n}", finding.kind, float(n))
                events.append("raise")
            elif isinstance(action, Clear):
                del opened[finding.kind]
                events.append("clear")
    return events


def test_an_estimate_oscillating_at_the_minimum_raises_once_and_stays_raised() -> None:
    values = [0.79, 0.81, 0.795, 0.82, 0.78, 0.829, 0.79, 0.81]
    findings = [accuracy_finding(Estimate(0, 1, 100, v, v, 0, None), 0.8) for v in values]
    assert _simulate(findings) == ["raise"]
    back = accuracy_finding(Estimate(0, 1, 100, 0.831, 0.8, 0, None), 0.8)
    assert _simulate([*findings, back]) == ["raise", "clear"]


def test_drift_holding_every_other_tick_raises_once_and_stays_raised() -> None:
    drift = AlertKind.INPUT_DRIFT
    holds = Finding(drift, True, 0.3, 0.25, {})
    calm = Finding(drift, False, 0.2, 0.25, {})
    # The window slides by a few predictions per tick: a calm tick's window is never
    # all fresh while the condition held a few ticks before.
    sequence = [holds if n % 2 == 0 else with_off_delay(calm, 5, WINDOW) for n in range(10)]
    assert _simulate(sequence) == ["raise"]
    assert _simulate([*sequence, with_off_delay(calm, WINDOW, WINDOW)]) == ["raise", "clear"]


def test_drift_clears_only_after_a_whole_window_without_it(store: Store) -> None:
    camera = Camera(store, seed=14)
    monitor = _monitor(store)
    camera.shoot(WINDOW)
    camera.shoot(WINDOW, brightness=0.75)
    (raised,) = monitor.tick(2000.0)
    states = []
    for n in range(10):  # normal images arrive, 20 per tick
        camera.shoot(20)
        states += [(n, a.state) for a in monitor.tick(2001.0 + n)]
    # Cleared once, and only when a whole window of normal images had arrived since the
    # condition last held (not at the first window that merely stopped being drifted).
    assert len(states) == 1 and states[0][1] is AlertState.CLEARED
    assert states[0][0] >= 5
    assert store.scalar("SELECT count(*) FROM alerts") == 1
    assert raised.condition is AlertKind.INPUT_DRIFT


# ---------------------------------------------------------------- 3. the MPP fit's labels


def test_the_mpp_fit_uses_the_managers_current_labels(store: Store) -> None:
    camera = Camera(store, seed=15)
    camera.evaluate(WINDOW)
    camera.evaluate(WINDOW, brightness=0.6, augmented=1)
    camera.shoot(WINDOW)
    monitor = _monitor(store)
    monitor.tick(2000.0)
    fitted = store.one("SELECT n_rows, accuracy FROM mpp_models WHERE model=?", (MODEL,))
    assert fitted == {"n_rows": 2 * WINDOW, "accuracy": 0.9}

    # An operator relabels 20 images the model got right (and their copies' label with
    # them); the station's reported label in `evaluations` stays as it was.
    right = [i for i in range(3, WINDOW) if i % 10 != 0][:20]
    with store.transaction() as conn:
        for i in right:
            image = f"h-{EDGE}-{i}"
            flipped = "scratch" if camera.labels[image] == "clean" else "clean"
            new = labels.Label(f"r-{i}", image, EDGE, flipped, "op", 850.0, labels.Origin.OPERATOR)
            assert labels.apply(conn, new, 2001.0).applied is labels.Applied.RELABELLED
        # Images without a label at the manager are left out of the fit.
        conn.execute(f"DELETE FROM labels WHERE prediction_id IN ('h-{EDGE}-1', 'h-{EDGE}-2')")
    camera.shoot(1)
    monitor.tick(2002.0)
    refitted = store.one("SELECT accuracy FROM mpp_models WHERE model=?", (MODEL,))
    # 98 labelled images and 98 copies; 20 of each now wrong, 1 and 2 were right.
    assert refitted == {"accuracy": pytest.approx((2 * (90 - 2) - 2 * 20) / (2 * 98))}


# ---------------------------------------------------------------- 4. a corrupt predictor


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '{"format": "fedge.mpp.logistic", "version": 1, "n_fit": true}', "{"],
)
def test_a_corrupt_stored_predictor_is_refitted(store: Store, text: str) -> None:
    camera = Camera(store, seed=16)
    camera.evaluate(WINDOW)
    camera.shoot(WINDOW)
    store.conn.execute(
        "INSERT INTO mpp_models (model, predictor, n_rows, accuracy, fitted_at) VALUES (?,?,?,?,?)",
        (MODEL, text, WINDOW, 0.5, 1.0),
    )
    _monitor(store).tick(2000.0)
    (row,) = alert_store.list_estimates(store)
    assert row.mpp is not None and row.mpp > 0.8
    stored = store.one("SELECT predictor, accuracy FROM mpp_models WHERE model=?", (MODEL,))
    assert stored is not None and stored["accuracy"] == 0.9 and stored["predictor"] != text


# ---------------------------------------------------------------- 5. announcing alerts


def test_an_alert_that_cannot_be_announced_is_not_stored_and_comes_back(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    camera = Camera(store, seed=17)
    camera.shoot(WINDOW)
    camera.shoot(WINDOW, brightness=0.75)
    monitor = _monitor(store)

    def broken(self: AlertView, fleet: str) -> Alert:
        raise ValidationError("detail is longer than 8192 characters")

    with monkeypatch.context() as patch:
        patch.setattr(AlertView, "message", broken)
        assert monitor.tick(2000.0) == []
    assert store.scalar("SELECT count(*) FROM alerts") == 0  # rolled back with its pair
    (raised,) = monitor.tick(2001.0)  # nothing new arrived: judged again all the same
    assert (raised.condition, raised.state) == (AlertKind.INPUT_DRIFT, AlertState.RAISED)


def test_an_operators_clearing_is_marked_announced_only_once_published(store: Store) -> None:
    camera = Camera(store, seed=18)
    camera.shoot(WINDOW)
    camera.shoot(WINDOW, brightness=0.75)
    monitor = _monitor(store)
    (raised,) = monitor.tick(2000.0)
    alert_store.acknowledge(store, raised.alert_id, "alice", "known", 2001.0)
    published: list[Alert] = []

    def refused(alert: Alert) -> bool:
        return False

    def accepted(alert: Alert) -> bool:
        published.append(alert)
        return True

    assert monitor.tick(2002.0, publish=refused) == []
    assert store.scalar("SELECT published_at FROM alert_acks") is None
    (announced,) = monitor.tick(2003.0, publish=accepted)
    assert published == [announced]
    assert (announced.alert_id, announced.cleared_by) == (raised.alert_id, "alice")
    assert store.scalar("SELECT published_at FROM alert_acks") == 2003.0
    assert monitor.tick(2004.0, publish=accepted) == [] and len(published) == 1


# ---------------------------------------------------------------- 6. the drift reference


def test_a_restarted_monitor_keeps_the_first_window_as_reference_after_pruning(
    store: Store,
) -> None:
    camera = Camera(store, seed=19)
    camera.shoot(WINDOW)
    camera.shoot(WINDOW)
    assert _monitor(store).tick(2000.0) == []
    (stored,) = store.query("SELECT first_rowid, last_rowid, rows FROM drift_references")
    assert (stored["first_rowid"], stored["last_rowid"]) == (1, WINDOW)
    assert len(json.loads(stored["rows"])) == WINDOW

    # The lamp drifts; retention prunes the first window; serve restarts.
    camera.shoot(WINDOW, brightness=0.75)
    store.conn.execute("DELETE FROM predictions WHERE rowid <= ?", (WINDOW,))
    camera.shoot(WINDOW, brightness=0.75)
    (raised,) = _monitor(store).tick(2010.0)
    assert raised.condition is AlertKind.INPUT_DRIFT
    assert json.loads(raised.detail)["reference_n"] == WINDOW


def test_a_stored_reference_that_is_unreadable_is_taken_again(store: Store) -> None:
    camera = Camera(store, seed=20)
    camera.shoot(2 * WINDOW)
    store.conn.execute(
        "INSERT INTO drift_references (edge, model, first_rowid, last_rowid, rows, "
        'created_at) VALUES (?,?,1,100,\'{"not": "rows"}\',0)',
        (EDGE, MODEL),
    )
    assert _monitor(store).tick(2000.0) == []
    assert store.scalar("SELECT count(*) FROM estimates") == 1


def test_sqlite_reports_expanded_statements() -> None:
    # The index test above EXPLAINs what the trace callback reports; that must carry
    # the bound values, or EXPLAIN would see placeholders.
    conn = sqlite3.connect(":memory:")
    seen: list[str] = []
    conn.set_trace_callback(seen.append)
    conn.execute("SELECT ?", (7,))
    assert seen == ["SELECT 7"]

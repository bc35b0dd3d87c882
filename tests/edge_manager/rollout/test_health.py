"""A moved edge's abort metrics read from a real SQLite store: minimum evidence, the
rollout's model only, and "since the move" by the manager's receive time."""

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.edge_manager.rollout import health
from fedge.edge_manager.rollout.health import MIN_ERROR_RATE_IMAGES
from fedge.edge_manager.store import Store

MOVED_AT = 1000.0  # manager time


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    store = Store(tmp_path / "manager.db")
    try:
        yield store.conn
    finally:
        store.close()


def _telemetry(
    conn: sqlite3.Connection, seq: int, received_at: float, *, errors: int, scored: int, at: float
) -> None:
    """One telemetry batch of the agent's cumulative counters (``at``: station time)."""
    conn.execute(
        "INSERT INTO batches (edge, stream, seq, session, n_records, received_at) "
        "VALUES ('st-01', 'telemetry', ?, 1, 2, ?)",
        (seq, received_at),
    )
    conn.executemany(
        "INSERT INTO telemetry (edge, seq, idx, name, value, at) VALUES ('st-01', ?, ?, ?, ?, ?)",
        [
            (seq, 0, health.ERRORS_METRIC, float(errors), at),
            (seq, 1, health.SCORED_METRIC, float(scored), at),
        ],
    )


def test_error_rate_waits_for_enough_images(conn: sqlite3.Connection) -> None:
    _telemetry(conn, 1, MOVED_AT - 5, errors=0, scored=100, at=MOVED_AT - 5)
    # One error in two images since the move: no rate yet (it would be 0.5).
    _telemetry(conn, 2, MOVED_AT + 5, errors=1, scored=101, at=MOVED_AT + 5)
    assert health.error_rate(conn, "st-01", MOVED_AT) is None
    _telemetry(conn, 3, MOVED_AT + 10, errors=2, scored=100 + MIN_ERROR_RATE_IMAGES - 2, at=0.0)
    assert health.error_rate(conn, "st-01", MOVED_AT) == pytest.approx(2 / MIN_ERROR_RATE_IMAGES)


def test_since_the_move_is_judged_by_the_managers_receive_time(
    conn: sqlite3.Connection,
) -> None:
    # The station's clock is an hour behind: its records say `at` before the move, yet
    # they were received after it, so they are the new model's.
    behind = MOVED_AT - 3600
    _telemetry(conn, 1, MOVED_AT - 5, errors=0, scored=100, at=behind - 5)
    _telemetry(conn, 2, MOVED_AT + 5, errors=20, scored=100, at=behind + 5)
    assert health.error_rate(conn, "st-01", MOVED_AT) == 1.0
    conn.execute(
        "INSERT INTO batches (edge, stream, seq, session, n_records, received_at) "
        "VALUES ('st-01', 'predictions', 1, 1, 2, ?), ('st-01', 'predictions', 2, 1, 1, ?)",
        (MOVED_AT - 5, MOVED_AT + 5),
    )
    rows = [
        # received before the move (a station clock ahead says "after"): not counted
        ("p-1", 1, MOVED_AT + 3600, "inspect:4", 900.0),
        # received after the move with a clock behind: counted
        ("p-2", 2, behind, "inspect:4", 10.0),
        # the previous model's, received after the move (still in flight): not counted
        ("p-3", 2, behind, "inspect:3", 500.0),
    ]
    conn.executemany(
        "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
        "threshold, config_version, latency_ms, source) "
        "VALUES (?, 'st-01', ?, ?, ?, '{}', 'accept', 0.5, 1, ?, 'test')",
        rows,
    )
    assert health.latency_p95_ms(conn, "st-01", "inspect:4", MOVED_AT) == 10.0


def test_alerts_count_only_the_rollouts_model(conn: sqlite3.Connection) -> None:
    conn.executemany(
        "INSERT INTO alerts (alert_id, edge, model, kind, value, threshold, detail, raised_at, "
        "cleared_at) VALUES (?, 'st-01', ?, 'input_drift', 0.4, 0.25, '', ?, ?)",
        [
            ("a-1", "inspect:3", MOVED_AT + 1, None),  # the previous model's: not the new one's
            ("a-2", "inspect:4", MOVED_AT - 1, None),  # raised before the move
            ("a-3", "inspect:4", MOVED_AT + 2, MOVED_AT + 3),  # cleared
        ],
    )
    assert health.open_alerts(conn, "st-01", "inspect:4", MOVED_AT) == 0.0
    conn.execute(
        "INSERT INTO alerts (alert_id, edge, model, kind, value, threshold, detail, raised_at) "
        "VALUES ('a-4', 'st-01', 'inspect:4', 'input_drift', 0.4, 0.25, '', ?)",
        (MOVED_AT + 4,),
    )
    assert health.open_alerts(conn, "st-01", "inspect:4", MOVED_AT) == 1.0

"""What agent.db costs per image stays flat as its prediction index fills (issue 25).

The SQLite VM steps of what the scoring path runs per image (recording a prediction, and
for an inbox file asking whether its arrival was scored) at 5,000 indexed predictions
are within 2x of the same at 100: index searches, never a scan of the table.
"""

import time
from pathlib import Path

from fedge.edge_agent.store import LocalStore
from fedge.protocols.records import PredictionRecord


def _record(index: int) -> PredictionRecord:
    return PredictionRecord(
        f"p-{index:06d}", time.time(), "m:1", {"clean": 0.9, "scratch": 0.1}, "accept", 0.5, 1, 0.1
    )


def _filled(path: Path, n: int) -> LocalStore:
    store = LocalStore(path)
    for start in range(0, n, 100):
        batch = range(start, min(n, start + 100))
        store.add_predictions([_record(i) for i in batch], [f"arrival-{i}" for i in batch])
    return store


def _steps(store: LocalStore, index: int) -> int:
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    store._conn.set_progress_handler(count, 1)
    try:
        assert not store.scored_arrival(f"new-{index}", f"file:new-{index}.png", 0.0)
        store.add_predictions([_record(100_000 + index)], [f"new-{index}"])
        assert store.scored_arrival(f"new-{index}", f"file:new-{index}.png", 0.0)
    finally:
        store._conn.set_progress_handler(None, 0)
    return steps


def test_an_inbox_arrival_costs_the_same_at_5000_predictions_as_at_100(tmp_path: Path) -> None:
    small = _filled(tmp_path / "small.db", 100)
    full = _filled(tmp_path / "full.db", 5000)
    small_steps = min(_steps(small, i) for i in range(5))
    full_steps = min(_steps(full, i) for i in range(5))
    # A scan of 5,000 predictions alone is tens of thousands of steps.
    assert full_steps <= 2 * small_steps, (full_steps, small_steps)


def test_the_log_is_checkpointed_off_the_scoring_path(tmp_path: Path) -> None:
    """A thread of the store's own copies the write-ahead log into the file, so commits
    do not (the automatic checkpoint is only the backstop); closing stops it."""
    store = LocalStore(tmp_path / "agent.db")
    try:
        start = (tmp_path / "agent.db").stat().st_size
        for index in range(200):  # one commit each, as single images are recorded
            store.add_predictions([_record(index)])
        deadline = time.monotonic() + 10.0
        while (tmp_path / "agent.db").stat().st_size <= start and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "agent.db").stat().st_size > start  # pages reached the file
        assert store.checkpoint_failures == 0
    finally:
        store.close()
    assert not store._checkpointer.is_alive()

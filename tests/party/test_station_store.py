"""The station's kept images and labels: retention, the held-out share, safety."""

import os
import sqlite3
import time
from pathlib import Path

import pytest

from fedge.party.errors import StationDataError
from fedge.party.station_store import (
    ORPHAN_GRACE_S,
    PRUNE_BATCH,
    Retention,
    StationData,
    is_holdout,
)

PNG = b"\x89PNG fake bytes"


def test_labels_join_kept_images_by_prediction_id(tmp_path: Path) -> None:
    now = time.time()
    data = StationData(tmp_path, Retention(holdout_percent=0))
    assert data.keep("p-1", PNG, ".PNG", at=now + 1)
    data.keep("p-2", PNG, ".png", at=now + 2)
    data.label("p-1", "scratch", at=5.0)
    data.label("p-3", "clean", at=5.0)  # no image kept: not a training example
    items = data.labelled()
    assert [(i.prediction_id, i.label, i.path.name) for i in items] == [
        ("p-1", "scratch", "p-1.png")
    ]
    assert items[0].path.read_bytes() == PNG
    # A newer label replaces an older one; an older one arriving late does not.
    data.label("p-1", "clean", at=6.0)
    data.label("p-1", "scratch", at=4.0)
    assert [i.label for i in data.labelled()] == ["clean"]
    assert data.counts() == {"images": 2, "bytes": 2 * len(PNG), "labelled": 1}


def test_retention_drops_the_oldest_by_count_bytes_and_age(tmp_path: Path) -> None:
    base = time.time()
    data = StationData(
        tmp_path,
        Retention(max_images=3, max_bytes=10 * len(PNG), max_age_s=100),
        background=False,
    )
    for index in range(5):
        data.keep(f"p-{index}", PNG, ".png", at=base + index)
        data.label(f"p-{index}", "clean", at=base + index)
    data.prune(now=base + 10)
    assert [i.prediction_id for i in data.labelled()] == ["p-2", "p-3", "p-4"]
    assert sorted(p.name for p in data.images_dir.iterdir()) == ["p-2.png", "p-3.png", "p-4.png"]
    data.prune(now=base + 102.5)  # p-2 is now older than 100 s
    assert [i.prediction_id for i in data.labelled()] == ["p-3", "p-4"]
    small = StationData(tmp_path / "b", Retention(max_bytes=len(PNG) * 2 - 1), background=False)
    small.keep("p-a", PNG, ".png", at=base + 1)
    small.keep("p-b", PNG, ".png", at=base + 2)
    assert small.counts()["images"] == 1


def test_retention_zero_keeps_nothing(tmp_path: Path) -> None:
    data = StationData(tmp_path, Retention(max_images=0))
    assert not data.keep("p-1", PNG, ".png")
    assert data.counts()["images"] == 0


def test_the_held_out_share_is_stable_and_about_its_percentage() -> None:
    ids = [f"p-{i:05d}" for i in range(2000)]
    share = sum(is_holdout(i, 20) for i in ids) / len(ids)
    assert 0.17 < share < 0.23
    assert [is_holdout(i, 20) for i in ids] == [is_holdout(i, 20) for i in ids]
    assert not any(is_holdout(i, 0) for i in ids)


@pytest.mark.parametrize("bad", ["../etc/passwd", "p/1", ".hidden", "", "x" * 200])
def test_unsafe_prediction_ids_are_refused(tmp_path: Path, bad: str) -> None:
    data = StationData(tmp_path)
    with pytest.raises(StationDataError):
        data.keep(bad, PNG, ".png")
    assert data.counts()["images"] == 0


def test_a_file_without_its_row_is_swept_and_readonly_needs_a_store(tmp_path: Path) -> None:
    with pytest.raises(StationDataError, match="kept no images"):
        StationData(tmp_path, readonly=True)
    data = StationData(tmp_path)
    data.keep("p-1", PNG, ".png")
    orphan = data.images_dir / "p-9.png"
    orphan.write_bytes(PNG)  # a crash between file and row
    assert data.sweep_orphans() == 0  # too young: keep() may be about to write its row
    old = time.time() - ORPHAN_GRACE_S - 5
    os.utime(orphan, (old, old))
    assert data.sweep_orphans() == 1
    assert [p.name for p in data.images_dir.iterdir()] == ["p-1.png"]
    with pytest.raises(StationDataError, match="suffix"):
        data.keep("p-2", PNG, ".exe")


def _fill(data: StationData, n: int, start: int = 0) -> None:
    base = time.time()
    for index in range(start, start + n):
        data.keep(f"p-{index:06d}", PNG, ".png", at=base + index * 1e-3)


class _Work:
    """The SQL statements and SQLite VM steps a connection runs meanwhile."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.statements: list[str] = []
        self.steps = 0
        conn.set_trace_callback(self.statements.append)
        conn.set_progress_handler(self._step, 10)

    def _step(self) -> int:
        self.steps += 10
        return 0


def _work_per_image(data: StationData, start: int, images: int) -> _Work:
    work = _Work(data._conn)
    _fill(data, images, start)
    data._conn.set_trace_callback(None)
    data._conn.set_progress_handler(None, 0)
    return work


@pytest.mark.slow
def test_keeping_costs_the_same_at_5000_kept_images_as_at_100(tmp_path: Path) -> None:
    """Issue 25: keep() was O(kept) per image (prune read every row, every time)."""
    young = StationData(tmp_path / "young", background=False)  # the default: 5,000
    full = StationData(tmp_path / "full", background=False)
    _fill(young, 100)
    _fill(full, 5000)
    # The 5,001st image: the same two statements as the 101st.
    one_young = _work_per_image(young, 10_000, 1)
    one_full = _work_per_image(full, 10_000, 1)
    assert one_full.statements[0].startswith("SELECT bytes FROM images WHERE prediction_id=")
    assert len(one_full.statements) == len(one_young.statements) == 2
    assert one_full.steps <= 2 * one_young.steps
    # The next two batches, pruning as they go: at 5,000 kept images about the same
    # work per image as a store that prunes the same batches at 128.
    small = StationData(tmp_path / "small", Retention(max_images=2 * PRUNE_BATCH), background=False)
    _fill(small, 2 * PRUNE_BATCH)
    batch_small = _work_per_image(small, 20_000, 2 * PRUNE_BATCH)
    batch_full = _work_per_image(full, 20_000, 2 * PRUNE_BATCH)
    assert small.pruned == full.pruned == 2 * PRUNE_BATCH
    assert batch_full.steps <= 2 * batch_small.steps, (batch_full.steps, batch_small.steps)
    assert len(batch_full.statements) == len(batch_small.statements)
    # Nothing reads the whole table on the way.
    assert not any("count(" in s or "sum(" in s for s in batch_full.statements)
    assert full.counts()["images"] <= 5000 + PRUNE_BATCH
    full.prune()
    assert full.counts() == {"images": 5000, "bytes": 5000 * len(PNG), "labelled": 0}
    assert len(list(full.images_dir.iterdir())) == 5000


def test_the_pruner_thread_keeps_retention_off_the_callers_path(tmp_path: Path) -> None:
    data = StationData(tmp_path, Retention(max_images=50))
    _fill(data, 50 + 5 * PRUNE_BATCH)
    assert data.settled(timeout=30.0)
    data.close()  # stops the pruner (it may have been finishing a pass)
    # The running totals are read back from the table on open, and they agree.
    again = StationData(tmp_path, Retention(max_images=50), background=False)
    counts = again.counts()
    assert 50 <= counts["images"] < 50 + PRUNE_BATCH
    assert counts["bytes"] == counts["images"] * len(PNG)
    assert data.pruned == 50 + 5 * PRUNE_BATCH - counts["images"]
    assert len(list(again.images_dir.iterdir())) == counts["images"]


def test_training_copies_are_written_off_the_callers_thread_and_seen_by_every_read(
    tmp_path: Path,
) -> None:
    """In the agent's mode the keeper thread writes the copies (issue 25, item 2): reads
    in this process wait for them, close() drains them, a failed copy is counted and the
    next one is written."""
    data = StationData(tmp_path)
    for index in range(300):  # more than the keeper's queue: callers write the rest
        assert data.keep(f"p-{index:04d}", PNG, ".png")
    assert data.counts()["images"] == 300
    assert len(list(data.images_dir.glob("*.png"))) == 300
    data.label("p-0001", "scratch")
    assert [image.prediction_id for image in data.labelled()] == ["p-0001"]

    data.flush()
    broken = data.images_dir
    broken.rename(tmp_path / "gone")  # the copy's directory vanishes under the keeper
    data.keep("p-x", PNG, ".png")
    data.flush()
    assert data.keep_failures == 1
    (tmp_path / "gone").rename(broken)
    data.keep("p-y", PNG, ".png")
    data.close()  # drains the queue first
    with pytest.raises(StationDataError, match="closed"):
        data.keep("p-z", PNG, ".png")  # never queued to a keeper that is gone
    reopened = StationData(tmp_path, readonly=True)
    assert reopened.counts()["images"] == 301  # p-y kept, p-x lost and counted
    reopened.close()

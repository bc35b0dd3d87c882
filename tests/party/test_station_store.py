"""The station's kept images and labels: retention, the held-out share, safety."""

import time
from pathlib import Path

import pytest

from fedge.party.errors import StationDataError
from fedge.party.station_store import Retention, StationData, is_holdout

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
    data = StationData(tmp_path, Retention(max_images=3, max_bytes=10 * len(PNG), max_age_s=100))
    for index in range(5):
        data.keep(f"p-{index}", PNG, ".png", at=base + index)
        data.label(f"p-{index}", "clean", at=base + index)
    data.prune(now=base + 10)
    assert [i.prediction_id for i in data.labelled()] == ["p-2", "p-3", "p-4"]
    assert sorted(p.name for p in data.images_dir.iterdir()) == ["p-2.png", "p-3.png", "p-4.png"]
    data.prune(now=base + 102.5)  # p-2 is now older than 100 s
    assert [i.prediction_id for i in data.labelled()] == ["p-3", "p-4"]
    small = StationData(tmp_path / "b", Retention(max_bytes=len(PNG) * 2 - 1))
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
    (data.images_dir / "p-9.png").write_bytes(PNG)  # a crash between file and row
    assert data.sweep_orphans() == 1
    assert [p.name for p in data.images_dir.iterdir()] == ["p-1.png"]
    with pytest.raises(StationDataError, match="suffix"):
        data.keep("p-2", PNG, ".exe")

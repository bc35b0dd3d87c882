"""The inbox's done/ and failed/ folders stay bounded (a station's disk must not fill)."""

import os
from pathlib import Path

from fedge.edge_agent.inference.watcher import prune_finished


def test_the_oldest_and_the_too_old_leftovers_go(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    for index in range(10):
        path = tmp_path / f"part_{index:02d}.png"
        path.write_bytes(b"x")
        os.utime(path, (now - 1000 + index, now - 1000 + index))  # part_09 is the newest
    old = tmp_path / "ancient.png"
    old.write_bytes(b"x")
    os.utime(old, (now - 10 * 86400, now - 10 * 86400))
    removed = prune_finished(tmp_path, max_files=4, max_age_s=86400.0, now=now)
    assert removed == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "part_06.png", "part_07.png", "part_08.png", "part_09.png",
    ]  # fmt: skip
    assert prune_finished(tmp_path, max_files=4, max_age_s=86400.0, now=now) == 0

"""The manager asks the fleet for telemetry less often while its store is short of
space, and for the normal pace after (issue 33): the serve loop's side."""

import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import make_fleet_home

from fedge.edge_manager.desired import pace
from fedge.edge_manager.home.space import DiskSpace

LOW = DiskSpace("/srv/fedge", 1024 * 1024, 100 * 1024 * 1024)


def test_the_pacer_asks_once_per_change_and_says_why(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01", "st-02"))
    counters: Counter[str] = Counter()
    pacer = pace.Pacer(counters)
    with fh.fleet() as fleet:
        pacer.tick(fleet, False, None, 1.0)  # normal space, nothing asked before: nothing
        assert fleet.store.scalar("SELECT count(*) FROM desired WHERE kind='pace'") == 0
        pacer.tick(fleet, True, LOW, 2.0)
        pacer.tick(fleet, True, LOW, 3.0)  # still low: not asked again
        assert [pace.factor_at(fleet, e) for e in ("st-01", "st-02")] == [6.0, 6.0]
        reason = fleet.store.scalar(
            "SELECT json_extract(document, '$.reason') FROM desired WHERE kind='pace' LIMIT 1"
        )
        assert "short of space" in str(reason) and "1.0 MiB free" in str(reason)
    # A station enrolled while space is low is asked at the next look (every 10 s).
    fh.enroll("st-03")
    with fh.fleet() as fleet:
        pacer.tick(fleet, True, LOW, 5.0)
        assert pace.factor_at(fleet, "st-03") == 1.0
        pacer.tick(fleet, True, LOW, 12.5)
        assert pace.factor_at(fleet, "st-03") == 6.0
        pacer.tick(fleet, False, None, 13.0)
        assert [pace.factor_at(fleet, e) for e in ("st-01", "st-02", "st-03")] == [1.0] * 3
        versions = fleet.store.query("SELECT edge, version FROM desired WHERE kind='pace'")
    assert sorted((r["edge"], r["version"]) for r in versions) == [
        ("st-01", 2),
        ("st-02", 2),
        ("st-03", 2),
    ]
    assert counters["store.pace_changes"] == 3


class _FullFleet:
    """A fleet whose store refuses writes the way a full disk does."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def edges(self) -> list[str]:
        self.calls += 1
        raise self.error

    @property
    def store(self) -> Any:
        return self

    def transaction(self) -> Any:
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_full_store_is_asked_again_a_second_later() -> None:
    counters: Counter[str] = Counter()
    pacer = pace.Pacer(counters)
    full = _FullFleet(sqlite3.OperationalError("database or disk is full"))
    pacer.tick(full, True, LOW, 10.0)  # type: ignore[arg-type]
    pacer.tick(full, True, LOW, 10.5)  # type: ignore[arg-type]
    assert (full.calls, counters["store.pace_failed"], pacer.asked) == (1, 1, None)
    pacer.tick(full, True, LOW, 11.1)  # type: ignore[arg-type]
    assert full.calls == 2


def test_a_failure_that_is_not_the_disk_is_not_hidden() -> None:
    pacer = pace.Pacer(Counter())
    broken = _FullFleet(sqlite3.OperationalError("no such table: desired"))
    with pytest.raises(sqlite3.OperationalError):
        pacer.tick(broken, True, LOW, 1.0)  # type: ignore[arg-type]

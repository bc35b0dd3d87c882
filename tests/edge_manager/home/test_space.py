"""Headroom on the store's file system (issue 33): the judgement, and the two adapters."""

from pathlib import Path

import pytest

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home.layout import ManagerSettings
from fedge.edge_manager.home.space import (
    MIB,
    DiskSpace,
    Headroom,
    describe_space,
    low_line,
    measure,
    probe,
)

GIB = 1024 * MIB


def test_low_is_under_five_percent_or_500_mib_whichever_is_more_room() -> None:
    headroom = Headroom()
    # A large disk warns at 5 % (50 GiB of 1 TiB); a small one at 500 MiB.
    assert headroom.threshold_bytes(1024 * GIB) == int(0.05 * 1024 * GIB)
    assert headroom.threshold_bytes(4 * GIB) == 500 * MIB
    assert headroom.low(DiskSpace("/d", 49 * GIB, 1024 * GIB))
    assert not headroom.low(DiskSpace("/d", 52 * GIB, 1024 * GIB))
    assert headroom.low(DiskSpace("/d", 499 * MIB, 4 * GIB))
    assert not headroom.low(DiskSpace("/d", 501 * MIB, 4 * GIB))
    assert not Headroom(0.0, 0.0).low(DiskSpace("/d", 0, 4 * GIB))


def test_the_low_line_names_the_room_the_headroom_and_what_to_do() -> None:
    space = DiskSpace("/srv", 300 * MIB, 4 * GIB)
    assert describe_space(space) == "300.0 MiB free of 4.0 GiB (7.3 %) on /srv"
    line = low_line(space, Headroom())
    assert line.startswith("store space low: 300.0 MiB free of 4.0 GiB (7.3 %) on /srv, ")
    assert "headroom of 5 % or 500 MiB" in line
    assert "keep_*_days in manager.toml" in line


def test_measure_reads_the_nearest_existing_directory(tmp_path: Path) -> None:
    measured = measure(tmp_path / "not" / "yet" / "manager.db")
    assert measured is not None
    assert measured.path == str(tmp_path)
    assert 0 <= measured.free_bytes <= measured.total_bytes


def test_probe_writes_and_removes_one_file(tmp_path: Path) -> None:
    assert probe(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    missing = probe(tmp_path / "missing")
    assert missing is not None
    assert missing.startswith(f"cannot write 64 KiB in {tmp_path / 'missing'}: ")


def test_settings_refuse_a_relative_broker_persistence_and_negative_headroom() -> None:
    with pytest.raises(ManagerError, match="broker_persistence must be an absolute"):
        ManagerSettings("f", broker_persistence="data")
    with pytest.raises(ManagerError, match="low_space_mib must be a number >= 0"):
        ManagerSettings("f", low_space_mib=-1.0)
    assert ManagerSettings("f", broker_persistence="/var/lib/fedge-broker").broker_persistence

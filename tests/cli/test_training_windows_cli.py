"""``fedge edge set-training --window``: training windows in the station's signed config
(issue 31 item 2); a malformed window is refused before anything is signed."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.scheduler.service import fleet_stations
from fedge.edge_manager.scheduler.windows import IdleWindow, ShiftWindow


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fh = make_fleet_home(tmp_path)
    yield fh
    fh.close()


def fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, " ".join(result.output.replace("│", " ").split())  # rich box


def _versions(fh: FleetHome) -> int:
    return int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='config'"))


def test_windows_are_signed_into_the_config_and_read_by_the_scheduler(fh: FleetHome) -> None:
    code, output = fedge(
        fh, "edge", "set-training", "st-01", "--window", "22:00-06:00",
        "--window", "idle 30m", "--utc-offset-minutes", "60",
    )  # fmt: skip
    assert code == 0, output
    assert "st-01: desired config v1 (training enabled, 10 min, 1 thread(s), windows " in output
    assert "22:00-06:00, idle 30m (UTC+60 min))" in output
    with fh.fleet() as fleet:
        config = fleet.desired_config("st-01")
        assert config is not None and config.training is not None
        assert config.training.windows == ("22:00-06:00", "idle 30m")
        assert config.training.utc_offset_minutes == 60
        stations = {s.station_id: s for s in fleet_stations(fleet.store)}
    assert stations["st-01"].windows == (ShiftWindow(22 * 3600, 6 * 3600), IdleWindow(1800.0))
    assert stations["st-01"].utc_offset_s == 3600
    code, output = fedge(fh, "edge", "set-training", "st-01")
    assert code == 0 and "v2 (training enabled, 10 min, 1 thread(s))" in output, output
    with fh.fleet() as fleet:
        config = fleet.desired_config("st-01")
        assert config is not None and config.training is not None
        assert config.training.windows is None  # no window: any time


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--window", "25:00-06:00"], "neither a shift"),
        (["--window", "idle"], "neither a shift"),
        (["--window", "idle 0m"], "neither a shift"),
        (["--window", "06:00-06:00"], "opens and closes at the same time"),
        (["--window", "22:00-06:00", "--utc-offset-minutes", "900"], "within +-840"),
    ],
)
def test_a_bad_window_is_refused_before_signing(
    fh: FleetHome, args: list[str], message: str
) -> None:
    code, output = fedge(fh, "edge", "set-training", "st-01", *args)
    assert code == 2 and message in output, output
    assert _versions(fh) == 0

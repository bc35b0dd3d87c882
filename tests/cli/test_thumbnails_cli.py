"""``fedge edge set-thumbnails``: a signed config that shares, or stops; bad input refused."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.protocols.thumbnails import ThumbnailPolicy


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fh = make_fleet_home(tmp_path)
    yield fh
    fh.close()


def fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, " ".join(result.output.split())


def _versions(fh: FleetHome) -> int:
    return int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='config'"))


def test_share_then_stop_and_show_says_which(fh: FleetHome) -> None:
    code, output = fedge(fh, "edge", "show", "st-01")
    assert code == 0 and "images stay on the station" in output, output
    code, output = fedge(fh, "edge", "set-thumbnails", "st-01", "--all", "--size", "32")
    assert code == 0, output
    assert "st-01: desired config v1 (images shared as thumbnails: all scored, 32 px" in output
    with fh.fleet() as fleet:
        config = fleet.desired_config("st-01")
        assert config is not None and config.thumbnails == ThumbnailPolicy(32, False, 30)
        assert fleet.desired_config("st-02") is None
    code, output = fedge(fh, "edge", "show", "st-01")
    assert "images shared as thumbnails: all scored, 32 px, at most 30/min" in output
    code, output = fedge(fh, "edge", "set-thumbnails", "st-01", "--stop")
    assert code == 0 and "v2 (images stay on the station)" in output, output
    with fh.fleet() as fleet:
        config = fleet.desired_config("st-01")
        assert config is not None and config.thumbnails is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["st-01", "--size", "200"], "thumbnails.size must be in [16, 96]"),
        (["st-01", "--per-minute", "0"], "thumbnails.per_minute must be in [1, 600]"),
        (["st-99"], "unknown edge(s) st-99"),
    ],
)
def test_bad_input_is_one_clear_error_and_changes_nothing(
    fh: FleetHome, args: list[str], message: str
) -> None:
    code, output = fedge(fh, "edge", "set-thumbnails", *args)
    assert code != 0, output
    assert message in output
    assert "Traceback" not in output
    assert _versions(fh) == 0

"""A per-class threshold can be removed again (issue 15)."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.desired.decide import next_config
from fedge.protocols.config import EdgeConfig

EDGES = ("st-01", "st-02")


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=EDGES)
    publish_model(fleet_home, 1)
    yield fleet_home
    fleet_home.close()


def _fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, " ".join(result.output.split())


def _desired(fh: FleetHome, edge: str) -> EdgeConfig:
    with fh.fleet() as fleet:
        config = fleet.desired_config(edge)
    assert config is not None
    return config


def test_next_config_without_a_class_threshold() -> None:
    base = EdgeConfig(fleet="f", edge="e", version=3, class_thresholds={"scratch": 0.6})
    cleared = next_config(base, fleet="f", edge="e", now=1.0, clear_class="scratch")
    assert (cleared.version, cleared.class_thresholds) == (4, {})
    assert base.class_thresholds == {"scratch": 0.6}  # the old document is untouched


def test_unset_threshold_pushes_a_new_version_without_it(fh: FleetHome) -> None:
    code, output = _fedge(fh, "edge", "set-threshold", "st-01", "0.6", "--class", "scratch")
    assert code == 0, output
    version = _desired(fh, "st-01").version

    code, output = _fedge(fh, "edge", "unset-threshold", "st-01", "--class", "scratch")
    assert code == 0, output
    assert f"st-01: desired config v{version + 1} (no threshold for scratch" in output
    config = _desired(fh, "st-01")
    assert (config.version, config.class_thresholds) == (version + 1, {})
    code, output = _fedge(fh, "edge", "show", "st-01")
    assert code == 0 and "per class none" in output, output


def test_clearing_a_class_without_a_threshold_is_refused(fh: FleetHome) -> None:
    code, output = _fedge(fh, "edge", "set-threshold", "st-01", "0.6", "--class", "scratch")
    assert code == 0, output
    before = {edge: _desired(fh, edge).version for edge in ("st-01",)}

    code, output = _fedge(fh, "edge", "unset-threshold", "st-01", "--class", "scrach")
    assert code == 1, output
    assert "st-01 has no threshold for class 'scrach' (did you mean 'scratch'?)" in output
    assert "its per-class thresholds: scratch" in output and "nothing was changed" in output

    # `all` is refused as a whole when one edge has none: st-02 never had one.
    code, output = _fedge(fh, "edge", "unset-threshold", "all", "--class", "scratch")
    assert code == 1, output
    assert "st-02 has no threshold for class 'scratch'; its per-class thresholds: none" in output
    assert _desired(fh, "st-01").version == before["st-01"]
    with fh.fleet() as fleet:
        assert fleet.desired_config("st-02") is None

"""The gate's recommendation of a station's anomaly threshold (issue 28, item 4).

An anomaly job's publish keeps each station's reported threshold with the version it
was measured on; ``fedge edge set-threshold EDGE --anomaly recommended`` pushes the one
the edge reported for the anomaly model deployed beside its classifier. Real SQLite,
real signing, the CLI through typer's runner.
"""

from pathlib import Path

import numpy as np
import pytest
from conftest import make_fleet_home
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.registry.recommendations import (
    recommended_anomaly_threshold,
    write_anomaly_thresholds,
)
from fedge.models.tiny_onnx import build_brightness_anomaly, build_linear_classifier

REPORTED = {
    "st-01": {"threshold": 14.25, "holdout_examples": 40.0},
    "st-02": {"threshold": 19.5, "holdout_examples": 12.0},
}


def test_a_station_without_a_reported_threshold_is_told_why(tmp_path: Path) -> None:
    write_anomaly_thresholds(tmp_path, "inspect-anomaly", 1, REPORTED)
    assert recommended_anomaly_threshold(tmp_path, "inspect-anomaly", 1, "st-02") == 19.5
    with pytest.raises(ManagerError, match=r"st-03 reported no anomaly threshold.*st-01, st-02"):
        recommended_anomaly_threshold(tmp_path, "inspect-anomaly", 1, "st-03")
    with pytest.raises(ManagerError, match="published with no stations' anomaly thresholds"):
        recommended_anomaly_threshold(tmp_path, "inspect-anomaly", 2, "st-01")


def test_a_station_that_set_none_is_shown_its_own_reason(tmp_path: Path) -> None:
    reason = (
        "station st-04: 4 held-out good part(s) cannot set a threshold at a 0.05 false-alarm "
        "rate: ...; it needs at least 19 (label more parts good, or ask for a higher rate)"
    )
    write_anomaly_thresholds(
        tmp_path, "inspect-anomaly", 1, {**REPORTED, "st-04": {"reason": reason}}
    )
    with pytest.raises(
        ManagerError, match=r"st-04 reported no anomaly threshold.*needs at least 19"
    ):
        recommended_anomaly_threshold(tmp_path, "inspect-anomaly", 1, "st-04")
    with pytest.raises(ManagerError, match=r"st-03 .*took no part.*st-01, st-02\)"):
        recommended_anomaly_threshold(tmp_path, "inspect-anomaly", 1, "st-03")


def test_set_threshold_recommended_pushes_each_stations_own(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path / "fleet", edges=("st-01", "st-02", "st-03"))
    try:
        models = fh.root / "models"
        with fh.fleet() as fleet:
            fleet.registry.publish(
                build_linear_classifier(models / "c.onnx", weights=np.zeros((2, 1024))),
                name="inspect",
                version=1,
                classes=("clean", "scratch"),
                positive_classes=("scratch",),
            )
            fleet.registry.publish(
                build_brightness_anomaly(models / "a.onnx"),
                name="inspect-anomaly",
                version=1,
                classes=("good", "anomalous"),
                positive_classes=("anomalous",),
            )
            write_anomaly_thresholds(fleet.registry.artifacts, "inspect-anomaly", 1, REPORTED)
            fleet.deploy("inspect", 1, ["st-01", "st-02"], anomaly=("inspect-anomaly", 1))
            fleet.deploy("inspect", 1, ["st-03"])
        home = ["--home", str(fh.home.root)]
        runner = CliRunner(env={"COLUMNS": "200"})
        result = runner.invoke(
            app, ["edge", "set-threshold", "all", "--anomaly", "recommended", *home]
        )
        # st-03 has no anomaly model: refused before anything is pushed.
        assert result.exit_code != 0
        assert "st-03 has no anomaly model deployed beside its classifier" in result.output
        with fh.fleet() as fleet:
            assert fleet.desired_config("st-01") is None
        for edge, expected in (("st-01", 14.25), ("st-02", 19.5)):
            result = runner.invoke(
                app, ["edge", "set-threshold", edge, "--anomaly", "recommended", *home]
            )
            assert result.exit_code == 0, result.output
            assert f"reported by {edge} for inspect-anomaly:1" in result.output
            with fh.fleet() as fleet:
                config = fleet.desired_config(edge)
            assert config is not None and config.anomaly_threshold == expected
            # Tied to the anomaly model it was reported for: another one's scores are not
            # judged by it (a refit moves every score).
            assert config.anomaly_threshold_model == "inspect-anomaly:1"
            assert config.anomaly_threshold_for("inspect-anomaly:1") == expected
            assert config.anomaly_threshold_for("inspect-anomaly:2") is None
        result = runner.invoke(app, ["edge", "set-threshold", "st-03", "--anomaly", "x", *home])
        assert result.exit_code == 2 and "a number or 'recommended'" in result.output
    finally:
        fh.close()

"""The privacy floor in agent.toml: written at enrolment, changed only on the station (issue 24).

Real enrolment (a manager home, the fleet CA), real agent.toml files, the real ledger, and
the CLI through typer's runner; plus the ServerApp's rule that a job nobody trained fails.
"""

from pathlib import Path
from typing import Any

import pytest
from conftest import make_fleet_home
from typer.testing import CliRunner

from fedge.aggregator.fleet.server import no_training
from fedge.cli.main import app
from fedge.edge_agent.config.privacy_budget import read_floor, set_local_floor
from fedge.edge_agent.errors import SettingsError
from fedge.edge_agent.settings import load_settings
from fedge.privacy.floor import PrivacyFloor, default_floor


def test_enrolment_writes_the_default_floor_and_an_opt_out_only_when_asked(
    tmp_path: Path,
) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    try:
        assert fh.agent_settings("st-01").privacy_floor == default_floor(5000)
        opted = fh.enroll("st-02", privacy_floor=False)
        assert 'privacy_floor = "none"' in opted.read_text()
        assert load_settings(opted).privacy_floor is None
    finally:
        fh.close()


def test_an_agent_toml_without_a_floor_gets_the_default_for_its_images(tmp_path: Path) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    try:
        path = fh.agents["st-01"]
        lines = [ln for ln in path.read_text().splitlines() if "privacy_floor" not in ln]
        path.write_text("\n".join([*lines, "keep_images = 1000", ""]))
        assert load_settings(path).privacy_floor == default_floor(1000)
        path.write_text("\n".join([*lines, 'privacy_floor = "off"', ""]))
        with pytest.raises(SettingsError, match=r"privacy_floor must be a .* or \"none\""):
            load_settings(path)
        path.write_text("\n".join([*lines, "privacy_floor = { job_epsilon = -1 }", ""]))
        with pytest.raises(SettingsError, match="job_epsilon must be a number > 0"):
            load_settings(path)
    finally:
        fh.close()


def test_the_stations_operator_changes_the_floor_in_agent_toml_and_the_ledger(
    tmp_path: Path,
) -> None:
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    try:
        path = fh.agents["st-01"]
        tighter = PrivacyFloor(job_epsilon=2.0, lifetime_epsilon=4.0)
        data_dir = set_local_floor(path, tighter)
        assert load_settings(path).privacy_floor == tighter
        assert read_floor(data_dir) == (True, tighter)
        assert path.read_text().count("privacy_floor") == 1  # replaced, not appended

        result = CliRunner().invoke(
            app, ["agent", "privacy-floor", "--config", str(path), "--none"]
        )
        assert result.exit_code == 0, result.output
        assert "opted out" in result.output
        assert load_settings(path).privacy_floor is None
        assert read_floor(data_dir) == (True, None)

        result = CliRunner().invoke(
            app, ["agent", "privacy-floor", "--config", str(path), "--lifetime-epsilon", "12"]
        )
        assert result.exit_code == 0, result.output
        assert "epsilon <= 8 per job and 12" in " ".join(result.output.split())
        assert read_floor(data_dir)[1] == PrivacyFloor(lifetime_epsilon=12.0)
    finally:
        fh.close()


def test_a_job_in_which_no_station_trained_is_a_failure_saying_why() -> None:
    rounds: list[dict[str, Any]] = [
        {"failures": {"1001": "PrivacyFloorError: station st-02 refuses: ..."}},
        {"failures": {}},
    ]
    reason = no_training(rounds, False, {1001: "st-02"})
    assert reason is not None
    assert reason.startswith("no station trained in any of the job's 2 round(s)")
    assert "st-02: PrivacyFloorError" in reason and "nothing is published" in reason
    assert no_training(rounds, True, {}) is None
    assert no_training([], False, {}) is not None

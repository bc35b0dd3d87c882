"""CLI errors a station operator meets: one clear line, an exit code, nothing written."""

import fcntl
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FEDGE, FleetHome, deploy, make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_agent.errors import SettingsError
from fedge.edge_agent.settings import load_settings

EDGE = "st-01"


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE, "st-02"))
    yield fleet_home
    fleet_home.close()


def _fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, result.output


def _config_versions(fh: FleetHome) -> int:
    return int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='config'"))


# ---------------------------------------------------------------- (a) negative threshold


@pytest.mark.parametrize("args", [["-0.1"], ["--", "-0.1"], ["1.5"]])
def test_an_out_of_range_threshold_is_one_clear_error(fh: FleetHome, args: list[str]) -> None:
    code, output = _fedge(fh, "edge", "set-threshold", EDGE, *args)
    assert code == 1, output
    assert "threshold must be in [0, 1]" in output
    assert "No such option" not in output
    assert _config_versions(fh) == 0


# ---------------------------------------------------------------- (b) incomplete agent.toml


def test_an_incomplete_agent_toml_names_the_missing_settings(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('fleet = "plant-a"\nedge = "st-01"\n')
    with pytest.raises(SettingsError) as raised:
        load_settings(path)
    message = str(raised.value)
    assert "__init__" not in message
    for name in ("data_dir", "broker_host", "broker_port", "grpc_target"):
        assert name in message
    assert "manager_public_key" in message


# ---------------------------------------------------------------- (c) unknown class


def test_a_class_the_deployed_model_lacks_is_refused(fh: FleetHome) -> None:
    publish_model(fh, 1)
    deploy(fh, 1, [EDGE])
    code, output = _fedge(fh, "edge", "set-threshold", EDGE, "0.4", "--class", "dent")
    assert code == 1, output
    assert "dent" in output and "clean" in output and "scratch" in output
    assert _config_versions(fh) == 0
    code, output = _fedge(fh, "edge", "set-threshold", EDGE, "0.4", "--class", "scratch")
    assert code == 0, output
    assert _config_versions(fh) == 1


def test_without_a_deployment_the_class_must_be_in_a_published_model(fh: FleetHome) -> None:
    publish_model(fh, 1)
    code, output = _fedge(fh, "edge", "set-threshold", "st-02", "0.4", "--class", "dent")
    assert code == 1, output
    assert "dent" in output and "scratch" in output
    assert _config_versions(fh) == 0


# ---------------------------------------------------------------- (d) one agent per data dir


def _run_agent(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FEDGE), "agent", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.integration
def test_a_second_agent_on_the_same_data_dir_is_refused(fh: FleetHome) -> None:
    data_dir = fh.data_dir(EDGE)
    data_dir.mkdir(parents=True, exist_ok=True)
    lock_path = data_dir / "agent.lock"
    # Another agent's hold on the data dir (a lock is per open file: this one conflicts).
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, b"4242\n")
        result = _run_agent(fh.agents[EDGE])
    finally:
        os.close(fd)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "4242" in result.stderr
    assert str(data_dir) in result.stderr.replace("\n", "")


@pytest.mark.integration
def test_a_taken_http_port_is_one_clear_error(fh: FleetHome) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        fh.set_agent_option(EDGE, "http_port", port)
        result = _run_agent(fh.agents[EDGE])
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"port {port}" in result.stderr

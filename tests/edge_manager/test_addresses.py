"""Agents are given the manager's advertised address, never a wildcard (issue 15)."""

import json
import tomllib
from pathlib import Path

import pytest
from conftest import build_onnx_model, free_port
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.operations import opened
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings, is_wildcard


def _fedge(home: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, [*args, "--home", str(home)])
    return result.exit_code, " ".join(result.output.split())


def _ports() -> list[str]:
    return [
        *("--broker-port", str(free_port())),
        *("--grpc-port", str(free_port())),
        *("--superlink-port", str(free_port())),
    ]


def test_wildcards() -> None:
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "[::]", "", "*", " 0.0.0.0"))
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "::1", "mgr.lan", "10.0.0.5"))


def test_an_old_manager_toml_loads_and_gives_agents_its_bind_hosts(tmp_path: Path) -> None:
    home = ManagerHome(tmp_path / "home")
    home.init(ManagerSettings("plant-a", grpc_port=50551))
    text = home.settings_path.read_text()
    assert 'advertise_host = ""' in text
    old = "".join(line + "\n" for line in text.splitlines() if "advertise_host" not in line)
    home.settings_path.write_text(old)  # as written before advertise_host existed
    settings = home.settings()
    assert settings.advertise_host == ""
    assert settings.agent_grpc_target == "127.0.0.1:50551"
    assert settings.agent_address_problem() is None


def test_init_with_a_wildcard_needs_an_advertised_host(tmp_path: Path) -> None:
    home = tmp_path / "home"
    code, output = _fedge(home, "manager", "init", "--fleet", "plant-a", "--broker-host", "0.0.0.0")
    assert code == 1, output
    assert "broker_host '0.0.0.0'" in output and "--advertise-host HOST" in output
    assert not home.exists()

    args = ("manager", "init", "--fleet", "plant-a", "--broker-host", "0.0.0.0")
    code, output = _fedge(
        home, *args, "--grpc-host", "::", "--advertise-host", "mgr.lan", *_ports()
    )
    assert code == 0, output
    settings = ManagerHome(home).settings()
    assert (settings.broker_host, settings.advertise_host) == ("0.0.0.0", "mgr.lan")
    assert f"agents are given mgr.lan:{settings.grpc_port}" in output

    agent_toml = tmp_path / "st-01" / "agent.toml"
    code, output = _fedge(home, "edge", "enroll", "st-01", "--out", str(agent_toml))
    assert code == 0, output
    agent = tomllib.loads(agent_toml.read_text())
    assert agent["broker_host"] == "mgr.lan"
    assert agent["grpc_target"] == f"mgr.lan:{settings.grpc_port}"
    assert agent["superlink"] == f"mgr.lan:{settings.superlink_port}"

    # A deployment names the advertised gRPC target too (edges fetch the model there).
    model = build_onnx_model(tmp_path / "m.onnx")
    code, output = _fedge(
        home, "model", "publish", str(model), "--name", "inspect", "--version", "1",
        "--classes", "clean,scratch",
    )  # fmt: skip
    assert code == 0, output
    code, output = _fedge(home, "deploy", "inspect:1", "--edges", "st-01")
    assert code == 0, output
    with opened(ManagerHome(home)) as fleet:
        document = fleet.store.scalar("SELECT document FROM desired WHERE kind='deploy'")
    assert json.loads(document)["grpc_target"] == f"mgr.lan:{settings.grpc_port}"


def test_enroll_refuses_a_wildcard_and_names_the_fix(tmp_path: Path) -> None:
    home = ManagerHome(tmp_path / "home")
    home.init(ManagerSettings("plant-a", grpc_host="0.0.0.0", grpc_port=free_port()))
    out = tmp_path / "st-01" / "agent.toml"
    code, output = _fedge(home.root, "edge", "enroll", "st-01", "--out", str(out))
    assert code == 1, output
    assert "cannot enrol st-01: grpc_host '0.0.0.0'" in output
    assert "fedge manager advertise HOST" in output and "--advertise-host" in output
    assert not out.exists()  # nothing was created
    with opened(home) as fleet:
        assert fleet.edges() == [] and fleet.store.scalar("SELECT count(*) FROM certificates") == 0
    with opened(home) as fleet, pytest.raises(ManagerError, match="wildcard"):
        fleet.deploy("inspect", 1, [])  # unknown model aside, a wildcard is refused first

    code, output = _fedge(home.root, "manager", "advertise", "0.0.0.0")
    assert code == 1 and "is a wildcard" in output, output
    code, output = _fedge(home.root, "manager", "advertise", "fd00::5")
    assert code == 0, output
    assert f"gRPC [fd00::5]:{home.settings().grpc_port}" in output
    code, output = _fedge(home.root, "edge", "enroll", "st-01", "--out", str(out))
    assert code == 0, output
    agent = tomllib.loads(out.read_text())
    assert (agent["broker_host"], agent["grpc_target"]) == (
        "fd00::5",
        f"[fd00::5]:{home.settings().grpc_port}",
    )

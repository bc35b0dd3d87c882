"""The broker's save file where the operator chose (issue 33): named at `manager init`,
written there by a real Mosquitto."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security.enrollment import managed_broker
from fedge.transport.ports import free_port

pytestmark = pytest.mark.integration


def _init(home: Path, *extra: str) -> str:
    port = str(free_port())
    args = ["manager", "init", "--fleet", "plant-a", "--home", str(home), "--insecure"]
    result = CliRunner().invoke(app, [*args, "--broker-port", port, *extra])
    assert result.exit_code == 0, result.output
    return "".join(result.output.split())  # rich wraps long paths anywhere


def test_init_names_the_default_beside_the_store(tmp_path: Path) -> None:
    output = _init(tmp_path / "home")
    assert f"thebrokersavesitsstatein{tmp_path / 'home' / 'broker' / 'data'}" in output


def test_the_broker_saves_where_the_operator_chose(tmp_path: Path) -> None:
    chosen = tmp_path / "other-disk" / "mosquitto"
    output = _init(tmp_path / "home", "--broker-persistence", str(chosen))
    assert f"thebrokersavesitsstatein{chosen}(" in output
    home = ManagerHome(tmp_path / "home")
    assert home.settings().broker_persistence == str(chosen)
    broker = managed_broker(home)
    broker.start()
    broker.stop()  # SIGTERM: Mosquitto saves on the way out
    assert (chosen / "mosquitto.db").is_file()
    assert not (tmp_path / "home" / "broker" / "data" / "mosquitto.db").exists()

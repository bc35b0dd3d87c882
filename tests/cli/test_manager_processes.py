"""The manager's processes as an operator runs them: up/down/status, one per home, and
the broker's state told apart from the edges' (issue 15). Real Mosquitto and processes."""

import json
import os
from pathlib import Path

import pytest
from conftest import FleetHome, Processes, make_fleet_home, publish_model, wait_until

from fedge.edge_manager.home.run_dir import BrokerLink, Role, read_serve_state, running

pytestmark = pytest.mark.integration
EDGE = "st-01"


@pytest.fixture
def fh(tmp_path: Path, processes: Processes) -> FleetHome:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE,))
    processes.env["FEDGE_HOME"] = str(fleet_home.home.root)
    return fleet_home


def test_up_status_down_and_one_of_each_per_home(fh: FleetHome, processes: Processes) -> None:
    root = fh.home.root
    try:
        up = processes.cli("manager", "up", timeout_s=90)
        assert "broker     started" in up.stdout and "serve      started" in up.stdout
        assert "serve -> broker 127.0.0.1" in up.stdout and "connected" in up.stdout
        assert (root / "logs" / "serve.log").exists()
        serve = running(root, Role.SERVE)
        assert serve is not None and serve.pid

        again = processes.cli("manager", "up", timeout_s=60)
        assert "already running" in again.stdout

        # A second serve (or broker) on the same home is refused, naming the first.
        second = processes.cli("manager", "serve", expect=1)
        assert f"pid {serve.pid}" in second.stderr and "already running" in second.stderr
        assert "Traceback" not in second.stderr
        broker = running(root, Role.BROKER)
        assert broker is not None
        second_broker = processes.cli("manager", "broker", expect=1)
        assert f"pid {broker.pid}" in second_broker.stderr

        status = json.loads(processes.cli("manager", "status", "--json").stdout)
        assert status["processes"]["serve"]["pid"] == serve.pid
        # `up` started it, so its output is the log `up` named (issue 26)
        assert status["processes"]["serve"]["output"] == "log"
        assert status["processes"]["serve"]["logs"] == [str(root / "logs" / "serve.log")]
        assert status["broker_link"] == "connected"
        assert status["processes"]["superlink"]["running"] is False
    finally:
        down = processes.cli("manager", "down", timeout_s=60)
    assert f"serve      stopped (pid {serve.pid})" in down.stdout
    assert running(root, Role.SERVE) is None and running(root, Role.BROKER) is None
    status = json.loads(processes.cli("manager", "status", "--json").stdout)
    assert not any(p["running"] for p in status["processes"].values())


def test_serve_without_a_broker_does_not_claim_serving(
    fh: FleetHome, processes: Processes, tmp_path: Path
) -> None:
    publish_model(fh, 1)
    ready = tmp_path / "serve.ready"
    serve = processes.start(
        "serve", "manager", "serve", "--ready-file", str(ready), "--broker-wait", "1"
    )
    wait_until(ready.exists, 30, "serve to start")
    assert "serving" not in serve.stdout_path.read_text()
    assert "is not reachable" in serve.stderr_path.read_text()
    state = read_serve_state(fh.home.root)
    assert state is not None and state.pid == serve.pid
    assert state.broker is BrokerLink.UNREACHABLE

    # A push is stored (exit 0) and the operator is told nothing will publish it yet.
    pushed = processes.cli("edge", "set-threshold", EDGE, "0.4")
    assert "not connected to the broker" in pushed.stderr
    shown = processes.cli("edge", "show", EDGE, "--json")
    json.loads(shown.stdout)  # the warning is on stderr: scripts still get JSON
    assert "not connected to the broker" in shown.stderr

    processes.stop(serve)
    pushed = processes.cli("edge", "set-threshold", EDGE, "0.5")
    assert "`fedge manager serve` is not running" in pushed.stderr
    deployed = processes.cli("deploy", "inspect:1", "--edges", EDGE)
    assert "is not running" in deployed.stderr
    assert int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='config'")) == 2


def test_conflicting_deploy_targets_are_refused(fh: FleetHome, processes: Processes) -> None:
    publish_model(fh, 1)
    result = processes.cli("deploy", "inspect:1", "--edges", EDGE, "--all", expect=1)
    assert "--edges and --all" in result.stderr
    assert int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='deploy'")) == 0


def test_the_home_lock_survives_no_process(tmp_path: Path) -> None:
    """A pid file left by a dead process does not count as running (the lock is gone)."""
    path = tmp_path / "run" / "serve.pid"
    path.parent.mkdir()
    path.write_text(f"{os.getpid() + 100000}\n")
    assert running(tmp_path, Role.SERVE) is None

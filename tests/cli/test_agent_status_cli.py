"""``fedge agent status``, the threshold column of ``fedge edge list`` and the /tmp warning
of ``fedge agent install-service`` (issue 27, item 7), through typer's CliRunner.

Real agent files (the agent's LocalStore), a real agent answering its local API on a
socket, a real manager home and store.
"""

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.inference.local_api import serve_local_api
from fedge.edge_agent.settings import load_settings
from fedge.edge_agent.store import LocalStore
from fedge.edge_agent.systemd import hidden_by_private_tmp
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.records import PredictionRecord
from fedge.transport.ports import free_port

EDGE = "st-01"


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE,))
    yield fleet_home
    fleet_home.close()


def _fedge(*args: str, home: Path | None = None) -> tuple[int, str]:
    env = {} if home is None else {"FEDGE_HOME": str(home)}
    result = CliRunner().invoke(app, list(args), env={**env, "COLUMNS": "160"})
    # JSON on stdout alone (a warning that serve is not running goes to stderr).
    return result.exit_code, result.stdout if "--json" in args else result.output


def _seed(config_path: Path) -> None:
    """A station that scored 5 images (2 rejected), got 1 label, and applied config v2."""
    settings = load_settings(config_path)
    store = LocalStore(settings.data_dir / "agent.db")
    now = time.time()
    store.add_predictions(
        [
            PredictionRecord(
                f"p-{i}",
                now,
                "inspect:1",
                {"clean": 0.5, "scratch": 0.5},
                "reject" if i < 2 else "accept",
                0.5,
                2,
                1.0,
            )
            for i in range(5)
        ]
    )
    store.add_label("l-1", "p-0", "scratch", "operator", now)
    config = EdgeConfig(
        settings.fleet, EDGE, 2, default_threshold=0.55, class_thresholds={"scratch": 0.7}
    )
    store.put("applied_config", codec.encode(config).decode())
    store.close()


def test_a_stopped_agent_is_read_from_its_file_and_says_so(fh: FleetHome) -> None:
    config = fh.agents[EDGE]
    _seed(config)
    code, output = _fedge("agent", "status", "--config", str(config))
    assert code == 0, output
    first = output.splitlines()[0]
    assert first.startswith("read from ") and "agent.db, read-only" in first
    assert "the local API is off (http_port = 0 in agent.toml)" in first
    assert "default 0.55; per-class (overrides the default): scratch 0.7" in output
    assert "2 (40.0%)" in output  # rejects of the 5 held
    assert "unknown (the agent is not running)" in output
    code, output = _fedge("agent", "status", "--config", str(config), "--json")
    assert code == 0, output
    status = json.loads(output)
    assert status["running"] is False and status["config_version"] == 2
    assert status["counts"]["predictions"] == 5 and status["counts"]["labels"] == 1
    assert status["counts"]["pending_records"] == 6


@pytest.mark.integration
def test_a_running_agent_answers_and_its_status_matches_its_file(fh: FleetHome) -> None:
    config = fh.agents[EDGE]
    _seed(config)
    _, stopped = _fedge("agent", "status", "--config", str(config), "--json")
    port = free_port()
    fh.set_agent_option(EDGE, "http_port", port)
    agent = EdgeAgent(load_settings(config))  # not connected: no broker in this test
    server = serve_local_api(agent, port)
    try:
        code, output = _fedge("agent", "status", "--config", str(config), "--json")
        assert code == 0, output
        running = json.loads(output)
        assert running["running"] is True
        assert running["source"] == f"the running agent (http://127.0.0.1:{port}/v1/status)"
        assert running["broker_connected"] is False
        # The agent in memory and its file say the same about thresholds and counts.
        assert running["thresholds"] == json.loads(stopped)["thresholds"]
        assert running["counts"] == json.loads(stopped)["counts"]
        code, output = _fedge("agent", "status", "--config", str(config))
        assert code == 0, output
        assert "the running agent" in output.splitlines()[0]
        assert "not connected" in output
    finally:
        server.shutdown()
        server.server_close()
        agent.store.close()
        agent.station.close()
    code, output = _fedge("agent", "status", "--config", str(config))
    assert code == 0, output
    assert "connection refused" in output.splitlines()[0]
    assert "agent.db, read-only" in output.splitlines()[0]


def test_status_of_an_agent_that_never_ran_is_one_clear_error(fh: FleetHome) -> None:
    code, output = _fedge("agent", "status", "--config", str(fh.agents[EDGE]))
    assert code == 1
    assert "no agent file at" in output and "has this agent run" in output


def test_edge_list_shows_the_deciding_threshold_and_per_class_overrides(fh: FleetHome) -> None:
    publish_model(fh, 1)
    with fh.fleet() as fleet:
        fleet.set_threshold([EDGE], 0.6)
        fleet.set_threshold([EDGE], 0.8, class_name="scratch")
    code, output = _fedge("edge", "list", home=fh.home.root)
    assert code == 0, output
    assert "threshold" in output
    assert "0.5 (default)" in output  # nothing reported yet: the agent's own default
    # The station reports config v2 applied while serving inspect:1 (as ingest records it).
    fh.db.conn.execute(
        "UPDATE edges SET config_applied=2, serving='inspect:1', state='online' WHERE edge=?",
        (EDGE,),
    )
    code, output = _fedge("edge", "list", home=fh.home.root)
    assert code == 0, output
    assert "scratch 0.8 (per-class)" in output
    assert "default 0.6 decides no defect class" in output
    code, output = _fedge("edge", "list", "--json", home=fh.home.root)
    [row] = json.loads(output)
    assert row["threshold"].startswith("scratch 0.8 (per-class)")


def test_install_service_warns_of_paths_under_tmp(fh: FleetHome) -> None:
    config = fh.agents[EDGE]  # pytest's tmp_path: under /tmp
    result = CliRunner().invoke(
        app, ["agent", "install-service", "--config", str(config), "--out", "-"]
    )
    assert result.exit_code == 0, result.output
    assert "[Service]" in result.stdout
    assert "PrivateTmp=yes" in result.stdout
    assert f"config {config}" in result.stderr and "PrivateTmp=yes" in result.stderr
    assert "data_dir" in result.stderr


def test_paths_outside_tmp_are_not_flagged(tmp_path: Path, fh: FleetHome) -> None:
    settings = load_settings(fh.agents[EDGE])
    hidden = dict(hidden_by_private_tmp(settings, fh.agents[EDGE]))
    assert "config" in hidden and "data_dir" in hidden
    placed = settings.__class__(**{
        **vars(settings),
        "data_dir": Path("/var/lib/fedge/st-01"),
        "watch_dir": None,
        "ca_file": Path("/etc/fedge/st-01/ca.crt"),
        "cert_file": Path("/etc/fedge/st-01/agent.crt"),
        "key_file": Path("/var/tmp/agent.key"),
    })  # fmt: skip
    assert hidden_by_private_tmp(placed, Path("/etc/fedge/agent.toml")) == [
        ("key_file", Path("/var/tmp/agent.key"))
    ]

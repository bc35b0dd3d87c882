"""The whole fleet, as an operator runs it: separate ``fedge`` processes end to end.

Managed broker, ``manager serve`` and two agents; publish, deploy, push a threshold,
score images dropped into the agents' inboxes, label on the device and at the manager.
"""

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    EDGES,
    FleetHome,
    Processes,
    drop_images,
    free_port,
    mqtt_outcome,
    port_open,
    wait_until,
)

from fedge.edge_manager.home.layout import ManagerHome

pytestmark = pytest.mark.integration


def _show(processes: Processes, edge: str) -> dict[str, Any]:
    view: dict[str, Any] = json.loads(processes.cli("edge", "show", edge, "--json").stdout)
    return view


def test_whole_fleet_flow(tmp_path: Path, processes: Processes, onnx_model: Path) -> None:
    home_dir = tmp_path / "home"
    processes.env["FEDGE_HOME"] = str(home_dir)
    broker_port, grpc_port = free_port(), free_port()

    # -- set-up, all through the CLI
    processes.cli(
        "manager",
        "init",
        "--fleet",
        "plant-a",
        "--broker-port",
        str(broker_port),
        "--grpc-port",
        str(grpc_port),
    )
    fh = FleetHome(tmp_path, ManagerHome(home_dir))
    for edge in EDGES:
        toml = tmp_path / edge / "agent.toml"
        processes.cli("edge", "enroll", edge, "--out", str(toml))
        assert toml.stat().st_mode & 0o777 == 0o600, "agent.toml holds a secret"
        fh.agents[edge] = toml
        assert fh.inbox(edge) == fh.data_dir(edge) / "inbox"
    published = processes.cli(
        "model",
        "publish",
        str(onnx_model),
        "--name",
        "inspect",
        "--version",
        "1",
        "--classes",
        "clean,scratch",
        "--positive",
        "scratch",
    )
    assert "inspect:1" in published.stdout

    processes.pidfiles.append(home_dir / "broker" / "mosquitto.pid")
    try:
        processes.start("broker", "manager", "broker")
        wait_until(lambda: port_open(broker_port), 15, "the managed broker to listen")
        ready = tmp_path / "serve.ready"
        serve = processes.start("serve", "manager", "serve", "--ready-file", str(ready))
        agents = {
            edge: processes.start(edge, "agent", "run", "--config", str(fh.agents[edge]))
            for edge in EDGES
        }
        wait_until(ready.exists, 20, "manager serve to be ready")
        wait_until(
            lambda: {r["edge"]: r["state"] for r in fh.db.query("SELECT edge, state FROM edges")},
            30,
            "both agents to come online",
            expect=lambda states: states == dict.fromkeys(EDGES, "online"),
        )

        # -- deploy to both and wait until active
        deployed = processes.cli("deploy", "inspect:1", "--all", "--wait", "30")
        assert deployed.stdout.count("active") == 2, deployed.stdout
        rows = fh.db.query("SELECT edge, serving, deploy_stage FROM edges ORDER BY edge")
        assert [(r["serving"], r["deploy_stage"]) for r in rows] == [("inspect:1", "active")] * 2

        # -- a threshold for st-01 only; wait until the edge reports it applied
        processes.cli("edge", "set-threshold", "st-01", "0.72")
        view = wait_until(
            lambda: _show(processes, "st-01"),
            15,
            "st-01 to report the desired config applied",
            expect=lambda v: v["config_applied"] == v["desired_config_version"] == 1,
        )
        assert view["in_sync"] is True
        assert view["desired_config"]["default_threshold"] == 0.72
        assert view["config_status"] == "applied:1"
        assert _show(processes, "st-02")["config_applied"] == 0

        # -- images in, predictions out at the manager
        sources: dict[str, set[str]] = {}
        for seed, edge in enumerate(EDGES):
            names = drop_images(fh.inbox(edge), f"flow-{edge}", 12, seed=seed)
            sources[edge] = {f"file:{name}" for name in names}
        wait_until(
            lambda: fh.db.query("SELECT edge, count(*) AS n FROM predictions GROUP BY edge"),
            30,
            "12 predictions of each edge in the manager store",
            expect=lambda rows: rows == [{"edge": e, "n": 12} for e in EDGES],
        )
        expected_threshold = {"st-01": 0.72, "st-02": 0.5}
        expected_config = {"st-01": 1, "st-02": 0}
        for edge in EDGES:
            preds = fh.db.query("SELECT * FROM predictions WHERE edge=?", (edge,))
            assert {p["source"] for p in preds} == sources[edge]
            assert len({p["prediction_id"] for p in preds}) == 12
            for pred in preds:
                assert pred["model"] == "inspect:1"
                assert pred["threshold"] == expected_threshold[edge]
                assert pred["config_version"] == expected_config[edge]
                scores = json.loads(pred["scores"])
                assert set(scores) == {"clean", "scratch"}
                reject = scores["scratch"] >= expected_threshold[edge]
                assert pred["decision"] == ("reject" if reject else "accept")
            inbox = fh.inbox(edge)
            assert sorted(p.name for p in inbox.glob("*.png")) == []
            assert len(list((inbox / "done").glob("flow-*.png"))) == 12
            assert list((inbox / "failed").iterdir()) == []

        # -- labels: one on the device, one by an operator at the manager
        prediction_id = fh.db.query(
            "SELECT prediction_id FROM predictions WHERE edge='st-01' ORDER BY at LIMIT 1"
        )[0]["prediction_id"]
        device = processes.cli(
            "agent", "label", prediction_id, "scratch", "--config", str(fh.agents["st-01"])
        )
        operator = processes.cli("labels", "add", prediction_id, "clean")
        device_label, operator_label = device.stdout.strip(), operator.stdout.strip()
        assert device_label.startswith("l-") and operator_label.startswith("l-")
        # One current label per prediction (issue 15): the operator's, the newer one; the
        # device's is in the history, whichever of the two reached the manager first.
        labels = wait_until(
            lambda: fh.db.query(
                "SELECT label_id, prediction_id, edge, label, origin FROM labels UNION ALL "
                "SELECT label_id, prediction_id, edge, label, origin FROM label_history "
                "ORDER BY origin"
            ),
            20,
            "the device label and the operator label in the manager store",
            expect=lambda rows: len(rows) == 2,
        )
        assert labels == [
            {
                "label_id": device_label,
                "prediction_id": prediction_id,
                "edge": "st-01",
                "label": "scratch",
                "origin": "edge",
            },
            {
                "label_id": operator_label,
                "prediction_id": prediction_id,
                "edge": "st-01",
                "label": "clean",
                "origin": "operator",
            },
        ]
        assert fh.db.scalar("SELECT label_id FROM labels") == operator_label
        final = _show(processes, "st-01")
        assert final["labels"] == 1
        assert final["predictions"] == 12
        assert final["gaps"] == []
        assert final["rejections"] == 0

        # -- the CLI refuses bad input with exit code 1 and an error line
        bad = processes.cli("edge", "set-threshold", "st-01", "1.5", expect=1)
        assert "error" in bad.stderr
        processes.cli("labels", "add", "p-unknown", "clean", expect=1)
        processes.cli("deploy", "inspect:9", "--all", expect=1)

        assert serve.running() and all(agent.running() for agent in agents.values())
    finally:
        fh.close()


def test_managed_broker_exits_on_sigterm(fleet_home: FleetHome, processes: Processes) -> None:
    """`fedge manager broker` is a foreground service: SIGTERM stops it and its mosquitto."""
    processes.env["FEDGE_HOME"] = str(fleet_home.home.root)
    port = fleet_home.settings.broker_port
    processes.pidfiles.append(fleet_home.home.root / "broker" / "mosquitto.pid")
    broker = processes.start("broker", "manager", "broker")
    wait_until(
        lambda: "listening" in broker.stdout_path.read_text(), 15, "the broker's start-up line"
    )
    assert port_open(port)
    processes.signal(broker, signal.SIGTERM)
    wait_until(lambda: not port_open(port), 10, "mosquitto to stop listening")
    exited = wait_until(
        lambda: broker.popen.poll() is not None,
        15,
        "`fedge manager broker` to exit after SIGTERM",
    )
    assert exited


def test_edge_enrolled_while_the_broker_runs_can_connect(
    fleet_home: FleetHome, processes: Processes
) -> None:
    processes.env["FEDGE_HOME"] = str(fleet_home.home.root)
    port = fleet_home.settings.broker_port
    processes.pidfiles.append(fleet_home.home.root / "broker" / "mosquitto.pid")
    broker = processes.start("broker", "manager", "broker")
    wait_until(lambda: port_open(port), 15, "the managed broker to listen")

    toml = fleet_home.root / "st-03" / "agent.toml"
    processes.cli("edge", "enroll", "st-03", "--out", str(toml))
    fleet_home.agents["st-03"] = toml
    # The running broker re-reads its ACL on SIGHUP; that takes a moment.
    wait_until(
        lambda: mqtt_outcome(port, tls=fleet_home.tls_files("st-03"), client_id="st-03"),
        10,
        "the running broker to accept st-03",
        expect=lambda outcome: outcome == "accepted",
    )
    for edge in EDGES:
        assert mqtt_outcome(port, tls=fleet_home.tls_files(edge), client_id=edge) == "accepted"
    assert broker.running()

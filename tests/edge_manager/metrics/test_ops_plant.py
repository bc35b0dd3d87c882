"""A plant's ops stack against real processes (issue 27, items 1, 2, 6).

- A real Prometheus (Debian's ``prometheus``, run here on a free port with its own config
  and data directory) scrapes ``manager serve`` and two agents; a PromQL query through
  its HTTP API sees the manager's ingest counter rise while the agents score images.
- ``/healthz`` and ``/readyz`` answered by a real serve and agent; ``/readyz`` is 503,
  naming the broker, while the broker is stopped.
- A gRPC-mode agent (its MQTT port closed) SIGKILLed shows ``lost`` within 10 s.
"""

import dataclasses
import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    EDGES,
    FleetHome,
    Processes,
    deploy,
    free_port,
    port_open,
    publish_model,
    wait_deploy_done,
    wait_until,
    write_images,
)

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def _score(port: int, image: bytes) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/score",
        data=image,
        headers={"Content-Type": "image/png"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _set_metrics_port(fh: FleetHome) -> int:
    port = free_port()
    fh.home.save_settings(dataclasses.replace(fh.settings, metrics_port=port))
    return port


@dataclasses.dataclass
class Plant:
    fh: FleetHome
    processes: Processes
    metrics_port: int
    agent_ports: dict[str, int]
    broker: Any


@pytest.fixture
def plant(fleet_home: FleetHome, processes: Processes) -> Iterator[Plant]:
    """Broker, serve (metrics on a free port) and st-01, st-02 serving inspect:1."""
    fh = fleet_home
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    metrics_port = _set_metrics_port(fh)
    ports = {edge: free_port() for edge in EDGES}
    for edge, port in ports.items():
        fh.set_agent_option(edge, "http_port", port)
    processes.pidfiles.append(fh.home.root / "broker" / "mosquitto.pid")
    broker = processes.start("broker", "manager", "broker")
    wait_until(lambda: port_open(fh.settings.broker_port), 15, "the managed broker to listen")
    ready = fh.root / "serve.ready"
    processes.start("serve", "manager", "serve", "--ready-file", str(ready))
    wait_until(ready.exists, 20, "manager serve to be ready")
    publish_model(fh, 1, seed=1)
    agents = [
        processes.start(edge, "agent", "run", "--config", str(fh.agents[edge])) for edge in EDGES
    ]
    deployment = deploy(fh, 1, EDGES)
    for edge, agent in zip(EDGES, agents, strict=True):
        row = wait_deploy_done(fh, deployment, edge)
        assert row["deploy_stage"] == "active", agent.output()
    yield Plant(fh, processes, metrics_port, ports, broker)


def _prometheus(tmp_path: Path, targets: list[int]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "prometheus.yml"
    listed = ", ".join(f"'127.0.0.1:{p}'" for p in targets)
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: fedge\n    static_configs:\n      - targets: [{listed}]\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, port


def _query(port: int, promql: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    status, body = _get(url)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def _value(result: list[dict[str, Any]]) -> float:
    return float(result[0]["value"][1]) if result else -1.0


def test_a_real_prometheus_sees_the_ingest_counter_rise_while_images_are_scored(
    plant: Plant, tmp_path: Path
) -> None:
    targets = [plant.metrics_port, *plant.agent_ports.values()]
    proc, port = _prometheus(tmp_path / "prom", targets)
    try:
        wait_until(
            lambda: _get(f"http://127.0.0.1:{port}/-/ready")[0],
            30,
            "Prometheus",
            expect=(200).__eq__,
        )
        wait_until(
            lambda: _query(port, "sum(up)"),
            20,
            "all three targets up",
            expect=lambda r: _value(r) == 3,
        )
        images = [
            p.read_bytes() for p in write_images(tmp_path / "img", [f"{i}.png" for i in range(4)])
        ]
        records = 'sum(fedge_manager_ingest_records_total{stream="predictions"})'
        seen: list[float] = []
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and len({v for v in seen if v > 0}) < 3:
            for edge_port in plant.agent_ports.values():
                for image in images:
                    _score(edge_port, image)
            seen.append(_value(_query(port, records)))
            time.sleep(1.0)
        rising = [v for v in seen if v > 0]
        assert len(set(rising)) >= 3 and rising == sorted(rising), seen
        # Both stations' own series are there too, by edge.
        scored = _query(port, "sum by (edge) (fedge_agent_predictions_total)")
        assert {r["metric"]["edge"] for r in scored} == set(EDGES), scored
        latency = _query(port, "sum by (edge) (fedge_agent_inference_latency_seconds_count)")
        assert all(float(r["value"][1]) > 0 for r in latency) and len(latency) == 2, latency
        online = _query(port, 'fedge_edges{state="online"}')
        assert _value(online) == 2, online
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_health_and_readiness_of_serve_and_agent_and_the_broker_stopped(plant: Plant) -> None:
    serve = f"http://127.0.0.1:{plant.metrics_port}"
    agent = f"http://127.0.0.1:{plant.agent_ports[EDGES[0]]}"
    for base in (serve, agent):
        assert _get(f"{base}/healthz")[0] == 200
        status, body = _get(f"{base}/readyz")
        assert status == 200, body
        assert json.loads(body)["ready"] is True
    plant.processes.stop(plant.broker)
    for base in (serve, agent):
        status, body = wait_until(
            lambda base=base: _get(f"{base}/readyz"),  # type: ignore[misc]
            15,
            f"{base}/readyz to say not ready",
            expect=lambda reply: reply[0] == 503,
        )
        checks = json.loads(body)["checks"]
        broker_check = checks.get("broker", checks.get("uplink"))
        assert broker_check != "ok", checks
        assert _get(f"{base}/healthz")[0] == 200  # alive all the same


def test_a_grpc_mode_agent_sigkilled_shows_lost_within_ten_seconds(
    fleet_home: FleetHome, processes: Processes
) -> None:
    fh = fleet_home
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    edge = EDGES[0]
    # MQTT blocked: the agent's broker port is closed, so it reports over gRPC only.
    path = fh.agents[edge]
    lines = [
        ln
        for ln in path.read_text().splitlines()
        if not ln.startswith(("report_via =", "broker_port ="))
    ]
    lines.insert(0, f"broker_port = {free_port()}")
    lines.insert(0, 'report_via = "grpc"')
    path.write_text("\n".join(lines) + "\n")
    processes.pidfiles.append(fh.home.root / "broker" / "mosquitto.pid")
    processes.start("broker", "manager", "broker")
    wait_until(lambda: port_open(fh.settings.broker_port), 15, "the managed broker to listen")
    ready = fh.root / "serve.ready"
    processes.start("serve", "manager", "serve", "--ready-file", str(ready))
    wait_until(ready.exists, 20, "manager serve to be ready")
    agent = processes.start(edge, "agent", "run", "--config", str(path))
    wait_until(
        lambda: fh.edge_row(edge).get("state"),
        30,
        "the edge online over gRPC",
        expect="online".__eq__,
    )
    time.sleep(9.0)  # longer than edge_lost_after_s: its heartbeats keep it online
    assert fh.edge_row(edge)["state"] == "online", agent.output()
    processes.kill(agent)
    killed = time.monotonic()
    wait_until(
        lambda: fh.edge_row(edge).get("state"), 10.0, "the edge marked lost", expect="lost".__eq__
    )
    took = time.monotonic() - killed
    assert took <= 10.0, took

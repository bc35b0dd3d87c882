"""The agent rolls a failing model back on its own; thresholds follow the model it serves.

A real broker, the manager in-process and an agent process with a short probation (six
images): a model over its latency budget and a model whose scores collapsed are each
rolled back to the previous model, the manager sees ``rolled_back`` with the reason, and
a restarted agent keeps serving the previous model without applying the bad deployment
again; a good model passes its probation. Thresholds tied to inspect:1 apply to models
that recommend none, and yield to a model's own recommended thresholds.
"""

import io
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conftest import (
    FleetHome,
    Proc,
    Processes,
    agent_status,
    deploy,
    free_port,
    make_fleet_home,
    publish_model,
    set_threshold,
    wait_config_applied,
    wait_deploy_done,
    wait_until,
)
from PIL import Image

from fedge.edge_manager.registry import PublishedModel
from fedge.edge_manager.service import ManagerService
from fedge.models.tiny_onnx import build_linear_classifier
from fedge.protocols.manifest import Thresholds
from fedge.transport.broker import MosquittoBroker

pytestmark = pytest.mark.integration

EDGE = "st-01"
WINDOW = 6  # probation_images
THRESHOLD = 0.6
RECOMMENDED = 0.35


@dataclass
class Station:
    fh: FleetHome
    processes: Processes
    agent: Proc
    http_port: int
    scored: int = 0

    def status(self) -> dict[str, Any]:
        return agent_status(self.http_port)

    def score(self, count: int = 1) -> list[dict[str, Any]]:
        """Score ``count`` random images through the local API; their records."""
        records = []
        for _ in range(count):
            self.scored += 1
            pixels = np.random.default_rng(self.scored).integers(0, 256, (32, 32), np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG")
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.http_port}/v1/score",
                data=buffer.getvalue(),
                headers={"Content-Type": "image/png"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                records.append(json.loads(response.read()))
        return records

    def start_agent(self) -> None:
        self.agent = self.processes.start(
            EDGE, "agent", "run", "--config", str(self.fh.agents[EDGE])
        )
        wait_until(self.status, 20, "the agent's local API", expect=lambda s: s["connected"])

    def wait_rolled_back(self, deployment: str) -> dict[str, Any]:
        return wait_until(
            lambda: self.fh.edge_row(EDGE),
            20,
            f"{EDGE} to roll back {deployment}",
            expect=lambda r: (r["deploy_id"], r["deploy_stage"]) == (deployment, "rolled_back"),
        )

    def stages(self, deployment: str) -> list[str]:
        rows = self.fh.db.query(
            "SELECT stage FROM deploy_events WHERE deployment_id=? ORDER BY rowid", (deployment,)
        )
        return [r["stage"] for r in rows]


def _publish(
    fh: FleetHome,
    version: int,
    *,
    weights: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    thresholds: Thresholds | None = None,
    latency_budget_ms: float | None = None,
) -> PublishedModel:
    source = build_linear_classifier(
        fh.root / "models" / f"inspect-{version}.onnx", seed=version, weights=weights, bias=bias
    )
    with fh.fleet() as fleet:
        return fleet.registry.publish(
            source,
            name="inspect",
            version=version,
            classes=("clean", "scratch"),
            positive_classes=("scratch",),
            thresholds=thresholds,
            latency_budget_ms=latency_budget_ms,
        )


@pytest.fixture(scope="module")
def station(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Station]:
    """st-01 serving inspect:1 with a config (threshold 0.6) tied to it."""
    root = tmp_path_factory.mktemp("local-rollback")
    fh = make_fleet_home(root, edges=(EDGE,))
    http_port = free_port()
    fh.set_agent_option(EDGE, "http_port", http_port)
    fh.set_agent_option(EDGE, "probation_images", WINDOW)
    fh.set_agent_option(EDGE, "probation_min_images", 3)
    broker: MosquittoBroker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    processes = Processes(root / "logs")
    try:
        service.start()
        publish_model(fh, 1, seed=1)
        agent = processes.start(EDGE, "agent", "run", "--config", str(fh.agents[EDGE]))
        station = Station(fh, processes, agent, http_port)
        deployment = deploy(fh, 1, [EDGE])
        assert wait_deploy_done(fh, deployment, EDGE)["deploy_stage"] == "active", agent.output()
        version = set_threshold(fh, EDGE, THRESHOLD)
        with fh.fleet() as fleet:
            desired = fleet.desired_config(EDGE)
        assert desired is not None and desired.model == "inspect:1"  # tied by default
        wait_config_applied(fh, EDGE, version)
        yield station
    finally:
        processes.close()
        service.stop()
        broker.stop()
        fh.close()


def _deploy_active(station: Station, version: int) -> str:
    deployment = deploy(station.fh, version, [EDGE])
    row = wait_deploy_done(station.fh, deployment, EDGE)
    assert (row["deploy_stage"], row["serving"]) == ("active", f"inspect:{version}"), (
        station.agent.output()
    )
    return deployment


def test_a_model_over_its_latency_budget_is_rolled_back_and_stays_rolled_back(
    station: Station,
) -> None:
    # inspect:1 serves; its scores give the next model's baseline.
    assert {r["threshold"] for r in station.score(WINDOW)} == {THRESHOLD}
    assert station.status()["thresholds"]["source"] == "config"
    _publish(station.fh, 2, latency_budget_ms=0.001)  # no model scores in a microsecond
    deployment = _deploy_active(station, 2)
    probation = station.status()["probation"]
    assert (probation["state"], probation["model"], probation["previous"]) == (
        "on_probation",
        "inspect:2",
        "inspect:1",
    )

    # inspect:2 recommends no thresholds: the config set for inspect:1 applies, untied.
    records = station.score(WINDOW)
    assert {(r["model"], r["threshold"]) for r in records} == {("inspect:2", THRESHOLD)}
    row = station.wait_rolled_back(deployment)
    assert row["serving"] == "inspect:1"
    assert row["deploy_reason"].startswith("latency: p95 "), row["deploy_reason"]
    assert "> budget 0.001 ms over 6 image(s); serving inspect:1 again" in row["deploy_reason"]
    status = station.status()
    assert status["serving"] == "inspect:1"
    assert status["counters"]["thresholds.untied"] == 1
    assert status["counters"]["probation.failed.latency"] == 1
    assert status["thresholds"] == {
        "source": "config",
        "default_threshold": THRESHOLD,
        "class_thresholds": {},
        "config_version": 1,
        "tied_to": "inspect:1",
        "model": "inspect:1",
    }
    assert station.score()[0]["model"] == "inspect:1"

    # A restart serves inspect:1 and does not apply the retained inspect:2 deployment.
    station.processes.stop(station.agent)
    station.start_agent()
    status = wait_until(
        station.status,
        20,
        "the retained inspect:2 deployment to reach the restarted agent",
        expect=lambda s: s["counters"].get("deploy.stale", 0) >= 1,
    )
    assert status["serving"] == "inspect:1"
    assert station.score()[0]["model"] == "inspect:1"
    assert station.stages(deployment)[-1] == "rolled_back"
    assert (
        "active"
        not in station.stages(deployment)[station.stages(deployment).index("rolled_back") :]
    )
    assert station.fh.edge_row(EDGE)["deploy_stage"] == "rolled_back"
    assert not (station.fh.data_dir(EDGE) / "models" / "inspect" / "2").exists()  # pruned


def test_a_model_whose_scores_collapsed_is_rolled_back(station: Station) -> None:
    station.score(WINDOW)  # the restarted agent's baseline of inspect:1
    # Zero weights: the same scores for every image (a model trained into a constant).
    _publish(station.fh, 3, weights=np.zeros((2, 1024)), bias=np.array([3.0, -3.0]))
    deployment = _deploy_active(station, 3)
    assert {r["model"] for r in station.score(WINDOW)} == {"inspect:3"}
    row = station.wait_rolled_back(deployment)
    assert row["serving"] == "inspect:1"
    assert row["deploy_reason"].startswith("scores_collapsed: defect score std "), row
    assert "< floor 0.001 (the previous model's: " in row["deploy_reason"]
    assert station.score()[0]["model"] == "inspect:1"


def test_a_good_model_passes_probation_with_its_recommended_thresholds(
    station: Station,
) -> None:
    _publish(station.fh, 4, thresholds=Thresholds(RECOMMENDED))
    deployment = _deploy_active(station, 4)
    # The config is tied to inspect:1; inspect:4 brings its own thresholds.
    records = station.score(WINDOW)
    assert {(r["model"], r["threshold"]) for r in records} == {("inspect:4", RECOMMENDED)}
    status = wait_until(
        station.status,
        10,
        "inspect:4 to pass its probation",
        expect=lambda s: s["probation"]["state"] == "passed",
    )
    assert status["serving"] == "inspect:4"
    assert status["probation"]["reason"] == f"passed over {WINDOW} image(s)"
    assert (status["thresholds"]["source"], status["thresholds"]["tied_to"]) == (
        "model",
        "inspect:1",
    )
    assert station.fh.edge_row(EDGE)["deploy_stage"] == "active"
    assert station.stages(deployment)[-1] == "active"
    # A threshold set now is for inspect:4, and applies to it.
    version = set_threshold(station.fh, EDGE, 0.8)
    wait_config_applied(station.fh, EDGE, version)
    assert station.score()[0]["threshold"] == 0.8
    assert station.status()["thresholds"]["source"] == "config"


def test_models_dir_is_what_the_agent_keeps(station: Station) -> None:
    kept = sorted(p.name for p in (station.fh.data_dir(EDGE) / "models" / "inspect").iterdir())
    # The rolled-back models are gone; the good ones stay as fallbacks.
    assert kept == ["1", "4"], kept

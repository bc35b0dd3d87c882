"""The agent rolls a failing model back on its own; thresholds follow the model it serves.

A real broker, the manager in-process and agent processes with a short probation (six
images). Every test has its own station (edge, agent process and store) that starts
serving inspect:1 with a threshold tied to it, so each runs alone or in any order: a
model over its latency budget and a model whose scores collapsed are each rolled back to
the previous model, the manager sees ``rolled_back`` with the reason, and a restarted
agent keeps serving the previous model without applying the bad deployment again; a good
model passes its probation and the manager stores ``passed``; the manager going back to
a proven model is not undone by the agent; a model on probation through every restart
(SIGKILL) is rolled back at start-up; a rollback brings the previous model's threshold
back. Thresholds tied to inspect:1 apply to models that recommend none, and yield to a
model's own recommended thresholds.
"""

import io
import json
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
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
    wait_config_applied,
    wait_deploy_done,
    wait_until,
)
from PIL import Image

from fedge.edge_manager.registry.versions import PublishedModel
from fedge.edge_manager.serve import ManagerService
from fedge.models.tiny_onnx import build_linear_classifier
from fedge.protocols.manifest import Thresholds
from fedge.transport.broker import MosquittoBroker

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02", "st-03", "st-04", "st-05", "st-06")
WINDOW = 6  # probation_images
THRESHOLD = 0.6
RECOMMENDED = 0.35


@dataclass
class Station:
    fh: FleetHome
    processes: Processes
    agent: Proc
    http_port: int
    edge: str
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
            self.edge, "agent", "run", "--config", str(self.fh.agents[self.edge])
        )
        wait_until(self.status, 20, "the agent's local API", expect=lambda s: s["connected"])

    def wait_rolled_back(self, deployment: str) -> dict[str, Any]:
        return wait_until(
            lambda: self.fh.edge_row(self.edge),
            20,
            f"{self.edge} to roll back {deployment}",
            expect=lambda r: (r["deploy_id"], r["deploy_stage"]) == (deployment, "rolled_back"),
        )

    def stages(self, deployment: str) -> list[str]:
        rows = self.fh.db.query(
            "SELECT stage FROM deploy_events WHERE deployment_id=? ORDER BY rowid", (deployment,)
        )
        return [r["stage"] for r in rows]

    def row(self) -> dict[str, Any]:
        return self.fh.edge_row(self.edge)

    def deploy_active(self, version: int) -> str:
        deployment = deploy(self.fh, version, [self.edge])
        row = wait_deploy_done(self.fh, deployment, self.edge)
        assert (row["deploy_stage"], row["serving"]) == ("active", f"inspect:{version}"), (
            self.agent.output()
        )
        return deployment

    def set_threshold(self, value: float, model: str | None = None) -> int:
        with self.fh.fleet() as fleet:
            version = fleet.set_threshold([self.edge], value, model=model)[0].version
        wait_config_applied(self.fh, self.edge, version)
        return version


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
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHome]:
    """The manager, its broker, and every model the tests deploy (published once)."""
    root = tmp_path_factory.mktemp("local-rollback")
    fh = make_fleet_home(root, edges=EDGES)
    broker: MosquittoBroker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    try:
        service.start()
        publish_model(fh, 1, seed=1)
        _publish(fh, 2, latency_budget_ms=0.001)  # no model scores in a microsecond
        # Zero weights: the same scores for every image (a model trained into a constant).
        _publish(fh, 3, weights=np.zeros((2, 1024)), bias=np.array([3.0, -3.0]))
        _publish(fh, 4, thresholds=Thresholds(RECOMMENDED))
        _publish(fh, 5)
        yield fh
    finally:
        service.stop()
        broker.stop()
        fh.close()


StartStation = Callable[..., Station]


@pytest.fixture
def start_station(fleet: FleetHome, tmp_path: Path) -> Iterator[StartStation]:
    """A station of its own: ``edge``'s agent serving ``first`` with a threshold tied to it."""
    processes = Processes(tmp_path / "logs")

    def start(edge: str, first: int = 1) -> Station:
        http_port = free_port()
        fleet.set_agent_option(edge, "http_port", http_port)
        fleet.set_agent_option(edge, "probation_images", WINDOW)
        fleet.set_agent_option(edge, "probation_min_images", 3)
        agent = processes.start(edge, "agent", "run", "--config", str(fleet.agents[edge]))
        station = Station(fleet, processes, agent, http_port, edge)
        station.deploy_active(first)
        assert station.set_threshold(THRESHOLD) == 1
        with fleet.fleet() as manager:
            desired = manager.desired_config(edge)
        assert desired is not None and desired.model == f"inspect:{first}"  # tied by default
        return station

    try:
        yield start
    finally:
        processes.close()


def test_a_model_over_its_latency_budget_is_rolled_back_and_stays_rolled_back(
    start_station: StartStation,
) -> None:
    station = start_station("st-01")
    # inspect:1 serves; its scores give the next model's baseline.
    assert {r["threshold"] for r in station.score(WINDOW)} == {THRESHOLD}
    assert station.status()["thresholds"]["source"] == "config"
    deployment = station.deploy_active(2)
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
    assert station.row()["deploy_stage"] == "rolled_back"
    models = station.fh.data_dir(station.edge) / "models" / "inspect"
    assert sorted(p.name for p in models.iterdir()) == ["1"]  # inspect:2 was pruned


def test_a_model_whose_scores_collapsed_is_rolled_back(start_station: StartStation) -> None:
    station = start_station("st-02")
    station.score(WINDOW)  # inspect:1's baseline
    deployment = station.deploy_active(3)
    assert {r["model"] for r in station.score(WINDOW)} == {"inspect:3"}
    row = station.wait_rolled_back(deployment)
    assert row["serving"] == "inspect:1"
    assert row["deploy_reason"].startswith("scores_collapsed: defect score std "), row
    assert "< floor 0.001 (the previous model's: " in row["deploy_reason"]
    assert station.score()[0]["model"] == "inspect:1"


def test_a_good_model_passes_probation_with_its_recommended_thresholds(
    start_station: StartStation,
) -> None:
    station = start_station("st-03")
    deployment = station.deploy_active(4)
    assert station.row()["deploy_reason"] == "on probation (previous inspect:1)"
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
    # The manager is told: a ``passed`` event of the deployment, which stays active.
    wait_until(
        lambda: station.stages(deployment),
        10,
        "the manager to store the passed probation",
        expect=lambda stages: stages[-1:] == ["passed"],
    )
    assert "active" in station.stages(deployment)
    row = station.row()
    assert (row["deploy_id"], row["deploy_stage"], row["deploy_reason"]) == (
        deployment,
        "active",
        f"passed over {WINDOW} image(s)",
    )
    # A threshold set now is for inspect:4, and applies to it.
    station.set_threshold(0.8)
    assert station.score()[0]["threshold"] == 0.8
    assert station.status()["thresholds"]["source"] == "config"
    # The models directory holds what the agent keeps: both models, nothing else.
    models = station.fh.data_dir(station.edge) / "models" / "inspect"
    assert sorted(p.name for p in models.iterdir()) == ["1", "4"]


def test_the_manager_going_back_to_a_proven_model_is_not_undone(
    start_station: StartStation,
) -> None:
    """inspect:3 scores a steady line the same (its spread is nil); inspect:5 varies.

    Judged against inspect:5's spread, inspect:3 would "collapse" and be rolled back
    to inspect:5 -- the model the manager just moved the station away from.
    """
    station = start_station("st-04", first=3)
    station.score(WINDOW)
    first_model = station.deploy_active(5)
    assert {r["model"] for r in station.score(WINDOW)} == {"inspect:5"}
    wait_until(
        lambda: station.stages(first_model),
        10,
        "inspect:5 to pass its probation",
        expect=lambda stages: "passed" in stages,
    )
    back = station.deploy_active(3)  # e.g. a staged rollout's rollback
    assert station.row()["deploy_reason"] == "not on probation: inspect:3 is proven on this station"
    assert station.status()["probation"]["state"] != "on_probation"
    assert {r["model"] for r in station.score(WINDOW)} == {"inspect:3"}
    status = station.status()
    assert "probation.failed.scores_collapsed" not in status["counters"], status["counters"]
    assert status["serving"] == "inspect:3"
    # Active, then passed at once: a proven model has no probation to wait for, and a
    # staged rollout waiting for the station's verdict gets it now (issue 32, item 1).
    assert station.stages(back)[-2:] == ["active", "passed"]
    assert station.row()["serving"] == "inspect:3"


def test_a_model_on_probation_through_every_restart_is_rolled_back_at_start(
    start_station: StartStation,
) -> None:
    """An inference that kills the agent (a segfault, the OOM killer) is never judged on
    images: the agent counts its starts during the probation. SIGKILL stands for it."""
    station = start_station("st-05")
    deployment = station.deploy_active(5)
    for start in (1, 2, 3):
        station.processes.kill(station.agent)
        station.start_agent()
        probation = station.status()["probation"]
        assert (station.status()["serving"], probation["state"], probation["starts"]) == (
            "inspect:5",
            "on_probation",
            start,
        )
    station.processes.kill(station.agent)
    station.start_agent()
    assert station.status()["serving"] == "inspect:1"
    row = station.wait_rolled_back(deployment)
    assert row["serving"] == "inspect:1"
    assert row["deploy_reason"] == (
        "restarts: the agent restarted 4 times while this model was on probation (limit 3); "
        "serving inspect:1 again"
    )
    assert station.score()[0]["model"] == "inspect:1"


def test_a_rollback_brings_back_the_threshold_set_for_the_previous_model(
    start_station: StartStation,
) -> None:
    station = start_station("st-06")
    deployment = station.deploy_active(2)
    # The rollout's threshold for inspect:2 (tied to it) arrives while it is on probation.
    assert station.set_threshold(0.8) == 2
    records = station.score(WINDOW)
    assert {(r["model"], r["threshold"]) for r in records} == {("inspect:2", 0.8)}
    row = station.wait_rolled_back(deployment)
    assert row["deploy_reason"].endswith(
        "serving inspect:1 again with config v1 (set for it), not v2"
    )
    in_force = {
        "source": "config",
        "default_threshold": THRESHOLD,
        "class_thresholds": {},
        "config_version": 1,
        "tied_to": "inspect:1",
        "model": "inspect:1",
    }
    assert station.status()["thresholds"] == in_force
    assert {r["threshold"] for r in station.score(2)} == {THRESHOLD}

    # A restart: the retained config v2 arrives again and is not applied again.
    station.processes.stop(station.agent)
    station.start_agent()
    status = wait_until(
        station.status,
        20,
        "the retained config v2 to reach the restarted agent",
        expect=lambda s: s["counters"].get("config.stale", 0) >= 1,
    )
    assert status["thresholds"] == in_force
    # The manager's next config still wins.
    station.set_threshold(0.7, model="inspect:1")
    assert station.score()[0]["threshold"] == 0.7

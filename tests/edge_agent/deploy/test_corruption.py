"""A station whose active model went bad on disk, with real processes end to end.

One byte flipped in the active model file, then the agent restarted (issue "A
fault-injection and soak suite", defect 2): the agent used to serve nothing until a new
deployment, while the manager still showed the broken version serving and its deployment
active. It must fall back to the newest previous model that still verifies, say so to the
manager, and fetch the deployment again; the manager's view follows what the edge serves.

Managed broker, ``fedge manager serve`` and ``fedge agent run`` are separate processes;
models are published and deployed through the library, as an operator's CLI would.
"""

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    EDGES,
    FleetHome,
    Proc,
    Processes,
    agent_status,
    deploy,
    drop_images,
    free_port,
    port_open,
    prediction_for,
    publish_model,
    wait_deploy_done,
    wait_until,
)

from fedge.edge_manager.registry.versions import PublishedModel

pytestmark = pytest.mark.integration

EDGE = EDGES[0]


def _flip_byte(path: Path) -> bytes:
    """Flip one bit in the middle of ``path``; return the original bytes."""
    original = path.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return original


@dataclass
class Plant:
    fh: FleetHome
    processes: Processes
    http_port: int
    agent: Proc
    v2: PublishedModel
    v2_deployment: str
    images: int = 0

    def status(self) -> dict[str, Any]:
        return agent_status(self.http_port)

    def restart_agent(self) -> None:
        assert self.processes.stop(self.agent) == 0, self.agent.output()
        self.agent = self.processes.start(
            EDGE, "agent", "run", "--config", str(self.fh.agents[EDGE])
        )

    def active_file(self) -> Path:
        return self.fh.data_dir(EDGE) / "models" / "inspect" / "2" / "model.onnx"

    def events(self, deployment_id: str) -> list[dict[str, Any]]:
        return self.fh.db.query(
            "SELECT stage, reason, serving FROM deploy_events "
            "WHERE edge=? AND deployment_id=? ORDER BY rowid",
            (EDGE, deployment_id),
        )

    def show(self) -> dict[str, Any]:
        """``fedge edge show st-01 --json``: the manager's view, as an operator sees it."""
        view: dict[str, Any] = json.loads(self.processes.cli("edge", "show", EDGE, "--json").stdout)
        return view

    def score_one(self) -> dict[str, Any]:
        self.images += 1
        name = drop_images(self.fh.inbox(EDGE), f"probe-{self.images}", 1, seed=self.images)[0]
        return prediction_for(self.fh, EDGE, f"file:{name}")


@pytest.fixture
def plant(fleet_home: FleetHome, processes: Processes) -> Iterator[Plant]:
    """st-01 served inspect:1, then inspect:2 (both verified and kept on the station)."""
    fh = fleet_home
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    http_port = free_port()
    fh.set_agent_option(EDGE, "http_port", http_port)
    processes.pidfiles.append(fh.home.root / "broker" / "mosquitto.pid")
    processes.start("broker", "manager", "broker")
    wait_until(lambda: port_open(fh.settings.broker_port), 15, "the managed broker to listen")
    ready = fh.root / "serve.ready"
    processes.start("serve", "manager", "serve", "--ready-file", str(ready))
    wait_until(ready.exists, 20, "manager serve to be ready")
    publish_model(fh, 1, seed=1)
    v2 = publish_model(fh, 2, seed=2)
    agent = processes.start(EDGE, "agent", "run", "--config", str(fh.agents[EDGE]))
    for version in (1, 2):
        deployment = deploy(fh, version, [EDGE])
        row = wait_deploy_done(fh, deployment, EDGE)
        assert (row["deploy_stage"], row["serving"]) == ("active", f"inspect:{version}"), (
            agent.output()
        )
    yield Plant(fh, processes, http_port, agent, v2, deployment)


def _restore_failure(events: list[dict[str, Any]]) -> int | None:
    """Index of the deploy event that reported the failed restore, if any."""
    return next((i for i, e in enumerate(events) if e["reason"].startswith("restore_failed")), None)


def test_corrupted_active_model_is_fetched_again_and_served(plant: Plant) -> None:
    _flip_byte(plant.active_file())
    plant.restart_agent()

    events = wait_until(
        lambda: plant.events(plant.v2_deployment),
        40,
        "the agent to report the failed restore and the deployment active again",
        expect=lambda ev: _restore_failure(ev) is not None and ev[-1]["stage"] == "active",
    )
    failed_at = _restore_failure(events)
    assert failed_at is not None
    restore = events[failed_at]
    # What it said at start-up: the deployment's model failed its check, the previous
    # verified model serves meanwhile.
    assert restore["stage"] == "failed", events
    assert "hash_mismatch" in restore["reason"], restore
    assert restore["serving"] == "inspect:1", restore
    # Then it fetched the same deployment again and serves it.
    assert [e["stage"] for e in events[failed_at + 1 :]] == [
        "downloading",
        "verifying",
        "staged",
        "active",
    ], events
    assert events[-1]["serving"] == "inspect:2"
    assert hashlib.sha256(plant.active_file().read_bytes()).hexdigest() == plant.v2.manifest.sha256

    view = plant.show()
    assert (view["serving"], view["deploy_id"], view["deploy_stage"], view["state"]) == (
        "inspect:2",
        plant.v2_deployment,
        "active",
        "online",
    ), view
    status = plant.status()
    assert status["serving"] == "inspect:2"
    assert status["counters"].get("restore_failed") == 1, status
    assert plant.score_one()["model"] == "inspect:2"


def test_corrupted_active_model_falls_back_to_the_previous_verified_model(
    plant: Plant,
) -> None:
    _flip_byte(plant.active_file())
    # The registry's copy is bad too: fetching the deployment again cannot succeed.
    registry_copy = _flip_byte(plant.v2.path)
    plant.restart_agent()

    events = wait_until(
        lambda: plant.events(plant.v2_deployment),
        40,
        "the agent to report the failed restore and the failed fetch",
        expect=lambda ev: (
            (at := _restore_failure(ev)) is not None
            and len(ev) > at + 1
            and ev[-1]["stage"] == "failed"
        ),
    )
    failed_at = _restore_failure(events)
    assert failed_at is not None
    assert events[failed_at]["serving"] == "inspect:1"
    assert events[-1]["reason"].startswith("hash_mismatch"), events
    assert events[-1]["serving"] == "inspect:1"

    # The manager shows what the station serves: the previous model, the deployment failed.
    view = plant.show()
    assert (view["serving"], view["deploy_id"], view["deploy_stage"]) == (
        "inspect:1",
        plant.v2_deployment,
        "failed",
    ), view
    assert plant.status()["serving"] == "inspect:1"
    assert plant.score_one()["model"] == "inspect:1"

    # Restarting again changes nothing: the same fallback, and one more attempt to fetch.
    plant.restart_agent()
    wait_until(
        lambda: [e["stage"] for e in plant.events(plant.v2_deployment)],
        40,
        "a second failed restore and fetch",
        expect=lambda stages: stages.count("failed") == 4 and stages[-1] == "failed",
    )
    assert plant.status()["serving"] == "inspect:1"

    # The operator repairs the registry and deploys again: the station serves inspect:2.
    plant.v2.path.write_bytes(registry_copy)
    deployment = deploy(plant.fh, 2, [EDGE])
    row = wait_deploy_done(plant.fh, deployment, EDGE)
    assert (row["deploy_stage"], row["serving"]) == ("active", "inspect:2"), plant.agent.output()
    assert plant.score_one()["model"] == "inspect:2"


def test_old_models_are_pruned_and_the_kept_ones_stay(plant: Plant) -> None:
    """Defect 8: every deployment used to leave its model on the station for good."""
    for version in (3, 4, 5):
        publish_model(plant.fh, version, seed=version)
        deployment = deploy(plant.fh, version, [EDGE])
        row = wait_deploy_done(plant.fh, deployment, EDGE)
        assert (row["deploy_stage"], row["serving"]) == ("active", f"inspect:{version}")
    models = plant.fh.data_dir(EDGE) / "models" / "inspect"
    # The active model and the two before it are the fallbacks (restore.KEEP = 3).
    wait_until(
        lambda: sorted(int(p.name) for p in models.iterdir()),
        10,
        "the old models to be pruned",
        expect=lambda versions: versions == [3, 4, 5],
    )
    assert plant.status()["counters"]["models.pruned"] >= 2
    assert plant.status()["serving"] == "inspect:5"

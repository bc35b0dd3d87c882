"""An agent with a deep outbox through broker outages, against a real broker and manager.

After Mosquitto was stopped and restarted, agents with a backlog deadlocked (issue "A
fault-injection and soak suite", defect 1): the publisher thread held the in-flight lock
while calling into paho, and paho's network thread held its message mutex while the
agent's PUBACK callback waited for that lock. The agent then stopped publishing, never
reconnected, still said "connected" and ignored SIGTERM. Draining hundreds of one-record
batches while their PUBACKs stream back is where that interleaving happens; it is
exercised here several times over, and the agent must reconnect, deliver every record
exactly once and still stop on SIGTERM.

The manager runs in-process so that the test can publish a signed config (one record
per batch) through the manager's own session.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from operator import eq
from typing import Any

import pytest
from conftest import (
    FLEET,
    FleetHome,
    Proc,
    Processes,
    agent_status,
    count_predictions,
    deploy,
    done_count,
    drop_images,
    free_port,
    make_fleet_home,
    publish_model,
    wait_deploy_done,
    wait_until,
)

from fedge.edge_manager.serve import ManagerService
from fedge.protocols import topics
from fedge.protocols.config import EdgeConfig
from fedge.transport.broker import MosquittoBroker

pytestmark = pytest.mark.integration

EDGE = "st-01"
OUTAGES = 3
IMAGES_PER_OUTAGE = 150


@dataclass
class Plant:
    fh: FleetHome
    broker: MosquittoBroker
    service: ManagerService
    processes: Processes
    agent: Proc
    http_port: int

    def status(self) -> dict[str, Any]:
        return agent_status(self.http_port)

    def gaps(self) -> list[dict[str, Any]]:
        return self.fh.db.query("SELECT * FROM gaps WHERE edge=?", (EDGE,))


@pytest.fixture
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    """st-01 serving inspect:1 with one record per outbox batch, its local API on."""
    root = tmp_path_factory.mktemp("agent-outage")
    fh = make_fleet_home(root, edges=(EDGE,))
    http_port = free_port()
    fh.set_agent_option(EDGE, "http_port", http_port)
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    processes = Processes(root / "logs")
    try:
        service.start()
        publish_model(fh, 1, seed=1)
        agent = processes.start(EDGE, "agent", "run", "--config", str(fh.agents[EDGE]))
        deployment = deploy(fh, 1, [EDGE])
        row = wait_deploy_done(fh, deployment, EDGE)
        assert row["deploy_stage"] == "active", agent.output()
        # One record per batch, so an outage leaves hundreds of batches to drain.
        config = EdgeConfig(FLEET, EDGE, version=1, batch_max_records=1)
        assert service.mqtt.publish_and_wait(
            topics.down(FLEET, EDGE, topics.Down.CONFIG),
            service.key.sign(config),
            qos=1,
            retain=True,
            timeout_s=5,
        )
        wait_until(
            lambda: agent_status(http_port)["config_version"],
            15,
            "the agent to apply one record per batch",
            expect=lambda version: version == 1,
        )
        yield Plant(fh, broker, service, processes, agent, http_port)
    finally:
        processes.close()
        service.stop()
        broker.stop()
        fh.close()


@pytest.mark.timeout(240)
def test_outages_with_a_backlog_reconnect_and_deliver_every_record_once(plant: Plant) -> None:
    inbox = plant.fh.inbox(EDGE)
    expected = 0
    for outage in range(OUTAGES):
        plant.broker.stop()
        wait_until(
            lambda: plant.status()["connected"],
            15,
            "the agent to notice the broker is gone",
            expect=lambda connected: connected is False,
        )
        prefix = f"outage{outage}"
        drop_images(inbox, prefix, IMAGES_PER_OUTAGE, seed=outage)
        wait_until(
            partial(done_count, inbox, prefix),
            60,
            f"{IMAGES_PER_OUTAGE} images scored offline",
            expect=lambda n: n == IMAGES_PER_OUTAGE,
        )
        wait_until(
            lambda: plant.status()["backlog"]["outbox_batches"],
            15,
            "the offline predictions sealed into one batch each",
            expect=lambda n: n >= IMAGES_PER_OUTAGE,
        )
        plant.broker.start()
        expected += IMAGES_PER_OUTAGE

        wait_until(
            lambda: (count_predictions(plant.fh, EDGE), plant.gaps()),
            90,
            f"exactly {expected} predictions, each stored once, and no open gap "
            f"(after outage {outage + 1})",
            expect=partial(eq, ({"n": expected, "ids": expected, "sources": expected}, [])),
        )
        status = wait_until(
            plant.status,
            30,
            "the agent's outbox to drain",
            expect=lambda s: s["backlog"] == {"pending_records": 0, "outbox_batches": 0},
        )
        assert status["connected"] is True
        assert plant.agent.running(), plant.agent.output()

    row = plant.fh.edge_row(EDGE)
    assert row["state"] == "online", row
    # Still responsive: SIGTERM stops it cleanly (a deadlocked agent ignored it).
    assert plant.processes.stop(plant.agent, timeout_s=15) == 0, plant.agent.output()
    wait_until(
        lambda: plant.fh.edge_row(EDGE)["state"],
        15,
        "the agent's goodbye at the manager",
        expect=lambda state: state == "offline",
    )

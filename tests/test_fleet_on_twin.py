"""The manager and agents on the in-memory broker: the fleet's behaviour in milliseconds.

The same ``ManagerService`` and ``EdgeAgent`` as everywhere else (real SQLite, gRPC,
ONNX Runtime), with MQTT served by transport/memory.py under the fleet's own ACL instead
of Mosquitto (tests/transport/test_memory_broker.py holds the twin to Mosquitto's
behaviour; the real-broker tests of these paths stay). Faults the twin injects: a broker
outage and a dropped station.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import (
    FleetHome,
    deploy,
    make_fleet_home,
    publish_model,
    set_threshold,
    stage_images,
    wait_config_applied,
    wait_deploy_done,
    wait_until,
)

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_manager.security import key_rotation
from fedge.edge_manager.security.enrollment import fleet_access
from fedge.edge_manager.serve import ManagerService
from fedge.protocols import topics
from fedge.protocols.thumbnails import ThumbnailPolicy
from fedge.transport.acl import fleet_acl
from fedge.transport.memory import MemoryBroker

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02")


@dataclass
class Twin:
    fh: FleetHome
    broker: MemoryBroker
    service: ManagerService
    agents: dict[str, EdgeAgent]


@pytest.fixture
def twin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Twin]:
    fh = make_fleet_home(tmp_path_factory.mktemp("twin"), edges=EDGES)
    broker = MemoryBroker(acl=fleet_acl(fleet_access(fh.home)))
    service = ManagerService(fh.home, sessions=broker.session)
    agents: dict[str, EdgeAgent] = {}
    try:
        service.start()
        for edge in EDGES:
            agents[edge] = EdgeAgent(fh.agent_settings(edge), sessions=broker.session)
            agents[edge].start()
        wait_until(
            lambda: [r["state"] for r in fh.db.query("SELECT state FROM edges ORDER BY edge")],
            10,
            "both stations online",
            expect=lambda states: states == ["online", "online"],
        )
        yield Twin(fh, broker, service, agents)
    finally:
        for agent in agents.values():
            agent.stop()
        service.stop()
        fh.close()


def _predictions(fh: FleetHome, edge: str) -> list[str]:
    rows = fh.db.query("SELECT prediction_id FROM predictions WHERE edge=?", (edge,))
    return [str(r["prediction_id"]) for r in rows]


def test_a_threshold_and_a_deployment_round_trip(twin: Twin) -> None:
    fh = twin.fh
    publish_model(fh, 1)
    deployment = deploy(fh, 1, ["st-01"])
    version = set_threshold(fh, "st-01", 0.66)
    assert wait_deploy_done(fh, deployment, "st-01")["deploy_stage"] == "active"
    wait_config_applied(fh, "st-01", version)
    agent = twin.agents["st-01"]
    assert agent.serving == "inspect:1"
    assert agent.config is not None and agent.config.default_threshold == 0.66
    assert twin.agents["st-02"].applied_version == 0
    # Retained on the twin as on Mosquitto: what a reconnecting station is told.
    assert twin.broker.retained(topics.down(fh.settings.fleet, "st-01", topics.Down.CONFIG))


def test_records_survive_a_broker_outage_once_each(twin: Twin) -> None:
    fh, agent = twin.fh, twin.agents["st-02"]
    publish_model(fh, 1)
    wait_deploy_done(fh, deploy(fh, 1, ["st-02"]), "st-02")
    before = {s.record.prediction_id for s in agent.score_many([np.zeros((32, 32))] * 3)}
    wait_until(lambda: set(_predictions(fh, "st-02")), 10, "3 predictions", expect=before.__le__)
    twin.broker.stop()
    wait_until(lambda: not agent.mqtt.connected.is_set(), 5, "st-02 to notice the outage")
    during = {s.record.prediction_id for s in agent.score_many([np.ones((32, 32))] * 4)}
    twin.broker.start()
    stored = wait_until(
        lambda: _predictions(fh, "st-02"),
        15,
        "the 4 predictions scored during the outage",
        expect=lambda ids: (before | during) <= set(ids),
    )
    assert len(stored) == len(set(stored)) == 7  # each once
    # The station came back to the same session: it was never marked lost for good.
    wait_until(lambda: fh.edge_row("st-02")["state"], 5, "st-02 online", expect="online".__eq__)


def test_a_dropped_station_comes_back_with_a_new_session(twin: Twin) -> None:
    fh = twin.fh
    session = int(fh.edge_row("st-01")["session"])
    twin.broker.drop("st-01")  # its will first, then its reconnect and a new birth
    row = wait_until(
        lambda: fh.edge_row("st-01"),
        5,
        "st-01 back online in a new session",
        expect=lambda r: r["state"] == "online" and int(r["session"]) > session,
    )
    assert row["session"] == session + 1
    assert twin.agents["st-01"].counters["connects"] == 2
    version = set_threshold(fh, "st-01", 0.4)
    wait_config_applied(fh, "st-01", version)


def test_a_key_rotation_on_the_twin(twin: Twin) -> None:
    fh = twin.fh
    rotated = key_rotation.rotate(fh.home)
    for edge in EDGES:
        wait_config_applied(fh, edge, set_threshold(fh, edge, 0.61))
        assert set(twin.agents[edge].keys) == {rotated.new_key_id}
    view = wait_until(
        lambda: key_rotation.trust_view(fh.home),
        10,
        "both stations to report the new key",
        expect=lambda v: sorted(v.on_current_key()) == list(EDGES),
    )
    assert view.behind() == []


def test_only_the_station_set_to_share_sends_thumbnails(twin: Twin) -> None:
    fh = twin.fh
    publish_model(fh, 1)
    for edge in EDGES:
        wait_deploy_done(fh, deploy(fh, 1, [edge]), edge)
    with fh.fleet() as fleet:
        (pushed,) = fleet.set_thumbnails(["st-01"], ThumbnailPolicy(size=32, rejects_only=False))
    wait_config_applied(fh, "st-01", pushed.version)
    images = [path.read_bytes() for path in stage_images(fh.root / "images" / "inbox", "t", 3)]
    scored = {
        edge: [agent.score_image(data, suffix=".png").record for data in images]
        for edge, agent in twin.agents.items()
    }
    wait_until(
        lambda: fh.db.query("SELECT edge, prediction_id, width, height FROM thumbnails"),
        10,
        "st-01's three thumbnails",
        expect=lambda rows: len(rows) == 3,
    )
    rows = fh.db.query("SELECT edge, prediction_id, width, height FROM thumbnails")
    assert {r["prediction_id"] for r in rows} == {p.prediction_id for p in scored["st-01"]}
    assert {(r["edge"], max(r["width"], r["height"])) for r in rows} == {("st-01", 32)}
    # st-02's images never left it: it made none, so the manager had none to drop.
    assert twin.agents["st-02"].counters["thumbnails.queued"] == 0
    assert twin.agents["st-01"].counters["thumbnails.queued"] == 3

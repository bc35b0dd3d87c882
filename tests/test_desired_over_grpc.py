"""A station whose MQTT is blocked gets its configs and deployments over gRPC (issue 9).

A real manager (``ManagerService``: managed Mosquitto, SQLite, gRPC) and two real agents:
st-01's agent.toml points at a port where no broker listens, so it only ever reaches the
manager over gRPC; st-02 is an ordinary MQTT station. A threshold push and a deployment
reach st-01 through DesiredSync, are applied, and its reports make ``fedge edge show``
converge; a forged config is refused by both stations alike.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import (
    FLEET,
    FleetHome,
    deploy,
    free_port,
    make_fleet_home,
    publish_model,
    set_threshold,
    wait_config_applied,
    wait_deploy_done,
    wait_until,
)

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_manager.fleet.views import EdgeView
from fedge.edge_manager.security import key_rotation
from fedge.edge_manager.serve import ManagerService
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.grpc import fedge_pb2, fedge_pb2_grpc
from fedge.protocols.signing import SigningKey, unverified_payload
from fedge.transport.broker import MosquittoBroker
from fedge.transport.grpc.client import DesiredClient, SyncError

pytestmark = pytest.mark.integration

BLOCKED = "st-01"
OPEN = "st-02"


@dataclass
class Plant:
    fh: FleetHome
    broker: MosquittoBroker
    service: ManagerService
    agents: dict[str, EdgeAgent]


@pytest.fixture
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    fh = make_fleet_home(tmp_path_factory.mktemp("desired-over-grpc"), edges=(BLOCKED, OPEN))
    # Blocked: nothing listens on this port, as when a firewall drops the broker's.
    fh.set_agent_option(BLOCKED, "broker_port", free_port())
    fh.set_agent_option(BLOCKED, "grpc_fallback_after_s", 0.5)
    fh.set_agent_option(BLOCKED, "grpc_poll_interval_s", 0.2)
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    agents: dict[str, EdgeAgent] = {}
    try:
        service.start()
        wait_until(service.mqtt.connected.is_set, 10, "the manager's MQTT session")
        for edge in (BLOCKED, OPEN):
            agents[edge] = EdgeAgent(fh.agent_settings(edge))
            agents[edge].start()
        wait_until(agents[OPEN].mqtt.connected.is_set, 10, f"{OPEN}'s MQTT session")
        yield Plant(fh, broker, service, agents)
    finally:
        for agent in agents.values():
            agent.stop()
        service.stop()
        broker.stop()
        fh.close()


def _show(fh: FleetHome, edge: str) -> EdgeView:
    with fh.fleet() as fleet:
        return fleet.show(edge)


def _wait_refused(fh: FleetHome, edge: str) -> dict[str, Any]:
    return wait_until(
        lambda: fh.edge_row(edge),
        20,
        f"{edge} to report the forged config refused",
        expect=lambda row: row.get("config_status") == "rejected:0",
    )


def test_a_threshold_and_a_deployment_reach_a_station_without_mqtt(plant: Plant) -> None:
    fh, agent = plant.fh, plant.agents[BLOCKED]
    publish_model(fh, 1)
    deployment = deploy(fh, 1, [BLOCKED])
    version = set_threshold(fh, BLOCKED, 0.72)

    row = wait_deploy_done(fh, deployment, BLOCKED)
    assert row["deploy_stage"] == "active", row
    wait_config_applied(fh, BLOCKED, version)
    assert agent.serving == "inspect:1"
    assert agent.config is not None and agent.config.default_threshold == 0.72
    shown = _show(fh, BLOCKED)
    assert shown.in_sync is True and shown.config_applied == version
    assert (shown.deploy_id, shown.deploy_stage) == (deployment, "active")
    assert (shown.state, shown.serving) == ("online", "inspect:1")

    # A later push arrives the same way: the station keeps polling.
    again = set_threshold(fh, BLOCKED, 0.6)
    wait_config_applied(fh, BLOCKED, again)
    assert agent.config is not None and agent.config.default_threshold == 0.6

    # All of it came over gRPC: the manager did publish to the broker, which the station
    # never reached.
    unpublished = fh.db.scalar("SELECT count(*) FROM desired WHERE published_at IS NULL")
    assert unpublished == 0
    assert not agent.mqtt.connected.is_set() and agent.counters["connects"] == 0
    assert agent.status()["desired_via_grpc"] is True
    assert agent.counters["desired.grpc.config"] == 2
    assert agent.counters["desired.grpc.deploy"] == 1
    assert agent.counters["config.applied"] == 2 and agent.counters["deploy.active"] == 1
    assert plant.service.grpc_services is not None
    counters = plant.service.grpc_services.counters
    assert counters["unauthenticated"] == 0 and counters["rejected"] == 0


def test_records_of_a_station_without_mqtt_reach_the_manager_over_grpc(plant: Plant) -> None:
    fh, agent = plant.fh, plant.agents[BLOCKED]
    publish_model(fh, 1)
    wait_deploy_done(fh, deploy(fh, 1, [BLOCKED]), BLOCKED)
    scored = agent.score_many([np.zeros((32, 32), np.float32)] * 5)
    ids = {s.record.prediction_id for s in scored}
    wait_until(
        lambda: {
            row["prediction_id"]
            for row in fh.db.query("SELECT prediction_id FROM predictions WHERE edge=?", (BLOCKED,))
        },
        20,
        "the predictions to reach the manager over gRPC",
        expect=lambda stored: ids <= stored,
    )
    assert agent.settings.report_via == "mqtt" and agent.counters["connects"] == 0
    # The manager stores a batch before its acknowledgement reaches the station: the
    # station counts it a moment after the rows are visible (CI once read it between).
    acked = wait_until(
        lambda: agent.counters["batches.acked"], 10, "the station to count the manager's ack"
    )
    assert acked >= 1


def test_a_forged_config_is_refused_over_grpc_as_over_mqtt(plant: Plant) -> None:
    fh = plant.fh
    applied = {edge: set_threshold(fh, edge, 0.7) for edge in (BLOCKED, OPEN)}
    for edge, version in applied.items():
        wait_config_applied(fh, edge, version)

    # Someone without the manager's key writes the next config into the store: the
    # manager hands it out (retained on MQTT for st-02, over gRPC to st-01) unopened.
    now = time.time()
    with fh.fleet() as fleet, fleet.store.transaction() as conn:
        for edge, version in applied.items():
            forged = EdgeConfig(FLEET, edge, version + 1, default_threshold=0.01)
            conn.execute(
                "INSERT INTO desired (edge, kind, version, document, envelope, created_at) "
                "VALUES (?, 'config', ?, ?, ?, ?)",
                (
                    edge,
                    version + 1,
                    codec.encode(forged).decode(),
                    SigningKey.generate().sign(forged).decode(),
                    now,
                ),
            )

    for edge, version in applied.items():
        row = _wait_refused(fh, edge)
        assert "bad_signature" in row["config_reason"], row
        assert row["config_applied"] == version
        agent = plant.agents[edge]
        assert agent.applied_version == version
        assert agent.config is not None and agent.config.default_threshold == 0.7
        assert agent.counters["config.rejected.bad_signature"] == 1
    # Polled again and again, the refused envelope was handled once.
    assert plant.agents[BLOCKED].counters["desired.grpc.config"] == 2


def test_an_edge_gets_only_its_own_documents(plant: Plant) -> None:
    fh = plant.fh
    version = set_threshold(fh, BLOCKED, 0.65)
    target = fh.agent_settings(BLOCKED).grpc_target
    own, other = fh.tls_files(BLOCKED), fh.tls_files(OPEN)
    with DesiredClient(target, BLOCKED, "", tls=own) as client:
        (doc,) = client.fetch({"config": version - 1})
    assert (doc.kind, doc.version) == ("config", version)
    # Signed with its expiry when written: never sent without one (freshness.py).
    sent = unverified_payload(doc.envelope, EdgeConfig)
    assert sent.expires_at is not None and sent.expires_at > time.time()
    assert (
        doc.envelope
        == fh.db.scalar(
            "SELECT envelope FROM desired WHERE edge=? AND kind='config' AND version=?",
            (BLOCKED, version),
        ).encode()
    )
    with DesiredClient(target, OPEN, "", tls=other) as client:
        assert client.fetch({}) == []  # st-02 has no config of its own yet
    # st-02's certificate asking for st-01's documents: the name in the request is not
    # the certificate's.
    with (
        DesiredClient(target, BLOCKED, "", tls=other) as client,
        pytest.raises(SyncError) as denied,
    ):
        client.fetch({})
    assert denied.value.code == "PERMISSION_DENIED"
    # Without a certificate of the fleet CA the TLS handshake itself fails.
    channel = grpc.insecure_channel(target)
    try:
        stub = fedge_pb2_grpc.DesiredSyncStub(channel)
        with pytest.raises(grpc.RpcError) as plain:
            stub.Fetch(fedge_pb2.DesiredRequest(edge=BLOCKED), timeout=10)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
    assert plant.service.grpc_services is not None
    counters = plant.service.grpc_services.counters
    assert counters["permission_denied"] == 1


def test_a_key_rotation_reaches_a_station_without_mqtt(plant: Plant) -> None:
    """The chain comes over DesiredSync first; the station's report of the key it now
    trusts goes back over gRPC; the config the new key signed is applied."""
    fh = plant.fh
    for edge in (BLOCKED, OPEN):
        wait_config_applied(fh, edge, set_threshold(fh, edge, 0.7))
    rotated = key_rotation.rotate(fh.home)
    for edge in (BLOCKED, OPEN):
        wait_config_applied(fh, edge, set_threshold(fh, edge, 0.55))
        agent = plant.agents[edge]
        assert set(agent.keys) == {rotated.new_key_id}
        assert agent.config is not None and agent.config.default_threshold == 0.55
    reports = wait_until(
        lambda: fh.db.query("SELECT edge, status, key_id FROM edge_trust ORDER BY edge"),
        20,
        "both stations to report the new key",
        expect=lambda rows: len(rows) == 2,
    )
    assert reports == [
        {"edge": edge, "status": "adopted", "key_id": rotated.new_key_id}
        for edge in (BLOCKED, OPEN)
    ]
    assert plant.agents[BLOCKED].counters["desired.grpc.trust"] == 1
    assert plant.agents[BLOCKED].counters["connects"] == 0

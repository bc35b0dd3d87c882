"""The agent under attack and under bad artifacts, against a real broker and manager.

Tampered, truncated, foreign-signed and broken models must fail their deployment with
the right reason while the previous model keeps serving; a forged config must be
refused; one edge's broker credentials must not reach another edge or another fleet.

The manager runs in-process here so that the test can publish as the manager user
through its own session (the broker uses the username as the client id: a second
connection as the manager would take the manager's session over).
"""

import io
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from operator import eq
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    FLEET,
    FleetHome,
    Proc,
    Processes,
    RawClient,
    agent_status,
    deploy,
    drop_images,
    free_port,
    make_fleet_home,
    prediction_for,
    publish_model,
    refused,
    set_threshold,
    wait_config_applied,
    wait_deploy_done,
    wait_until,
)
from PIL import Image

from fedge.edge_manager.registry import versions as registry
from fedge.edge_manager.registry.versions import PublishedModel
from fedge.edge_manager.serve import ManagerService
from fedge.protocols import codec, topics
from fedge.protocols.config import EdgeConfig
from fedge.protocols.signing import SigningKey
from fedge.transport.broker import FleetAccess, MosquittoBroker

pytestmark = pytest.mark.integration

EDGE = "st-01"
THRESHOLD = 0.6


@dataclass
class Plant:
    fh: FleetHome
    broker: MosquittoBroker
    service: ManagerService
    processes: Processes
    agent: Proc
    http_port: int
    config_version: int = 0
    images: int = 0

    def status(self) -> dict[str, object]:
        return agent_status(self.http_port)

    def counter(self, name: str) -> int:
        counters = self.status()["counters"]
        assert isinstance(counters, dict)
        return int(counters.get(name, 0))

    def score_one(self) -> dict[str, Any]:
        """Drop one image into the agent's inbox; return its prediction at the manager."""
        self.images += 1
        name = drop_images(self.fh.inbox(EDGE), f"probe-{self.images}", 1, seed=self.images)[0]
        return prediction_for(self.fh, EDGE, f"file:{name}")

    def models_dir(self, version: int) -> Path:
        return self.fh.data_dir(EDGE) / "models" / "inspect" / str(version)

    def deploy_stages(self, deployment_id: str) -> list[str]:
        rows = self.fh.db.query(
            "SELECT stage FROM deploy_events WHERE deployment_id=? ORDER BY rowid",
            (deployment_id,),
        )
        return [r["stage"] for r in rows]


@pytest.fixture(scope="module")
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    """st-01 running inspect:1 at threshold 0.6, with its local API on."""
    root = tmp_path_factory.mktemp("agent-faults")
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
        plant = Plant(fh, broker, service, processes, agent, http_port)
        deployment = deploy(fh, 1, [EDGE])
        row = wait_deploy_done(fh, deployment, EDGE)
        assert (row["deploy_stage"], row["serving"]) == ("active", "inspect:1"), agent.output()
        plant.config_version = set_threshold(fh, EDGE, THRESHOLD)
        wait_config_applied(fh, EDGE, plant.config_version)
        yield plant
    finally:
        processes.close()
        service.stop()
        broker.stop()
        fh.close()


def _assert_still_serving_v1(plant: Plant) -> None:
    assert plant.agent.running(), plant.agent.output()
    assert plant.status()["serving"] == "inspect:1"
    prediction = plant.score_one()
    assert prediction["model"] == "inspect:1"
    assert prediction["threshold"] == THRESHOLD


# ---------------------------------------------------------------- bad artifacts


def skip_manager_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager checks its copy before it issues a deployment (test_deploy_integrity);
    these tests damage the bytes as if after that check, so the edge must catch it."""
    monkeypatch.setattr(PublishedModel, "verify", lambda self: None)


def test_flipped_byte_fails_with_hash_mismatch(
    plant: Plant, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = publish_model(plant.fh, 2, seed=2)
    data = bytearray(published.path.read_bytes())
    data[len(data) // 2] ^= 0x01
    published.path.write_bytes(bytes(data))
    skip_manager_check(monkeypatch)
    deployment = deploy(plant.fh, 2, [EDGE])

    row = wait_deploy_done(plant.fh, deployment, EDGE)
    assert row["deploy_stage"] == "failed"
    assert row["deploy_reason"].startswith("hash_mismatch"), row
    assert row["serving"] == "inspect:1"
    assert "active" not in plant.deploy_stages(deployment)
    # The bad bytes were not kept, let alone loaded.
    assert not (plant.models_dir(2) / "model.onnx").exists()
    assert list(plant.models_dir(2).glob("model.onnx.*")) == []
    _assert_still_serving_v1(plant)


def test_truncated_artifact_fails_with_size_mismatch(
    plant: Plant, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = publish_model(plant.fh, 3, seed=3)
    data = published.path.read_bytes()
    published.path.write_bytes(data[: len(data) - 100])
    skip_manager_check(monkeypatch)
    deployment = deploy(plant.fh, 3, [EDGE])

    row = wait_deploy_done(plant.fh, deployment, EDGE)
    assert row["deploy_stage"] == "failed"
    assert row["deploy_reason"].startswith("size_mismatch"), row
    assert row["serving"] == "inspect:1"
    assert not (plant.models_dir(3) / "model.onnx").exists()
    _assert_still_serving_v1(plant)


def test_manifest_signed_by_another_key_is_refused_before_download(plant: Plant) -> None:
    publish_model(plant.fh, 4, seed=4, key=SigningKey.generate())

    deployment = deploy(plant.fh, 4, [EDGE])
    row = wait_deploy_done(plant.fh, deployment, EDGE)
    assert row["deploy_stage"] == "failed"
    assert row["deploy_reason"].startswith("bad_signature"), row
    assert row["serving"] == "inspect:1"
    # Refused before a byte was fetched: no download stage, nothing on disk.
    assert plant.deploy_stages(deployment) == ["failed"]
    assert not plant.models_dir(4).exists()
    _assert_still_serving_v1(plant)


@pytest.mark.parametrize(
    ("version", "n_outputs", "broken"),
    [(5, 3, False), (6, 2, True)],
    ids=["three-outputs-for-two-classes", "fails-on-every-run"],
)
def test_model_failing_its_smoke_test_is_not_swapped_in(
    plant: Plant, version: int, n_outputs: int, broken: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Publish refuses a class count that does not fit the outputs (test_class_names); the
    # edge must still catch a manifest that got past it (an older registry, a bug).
    monkeypatch.setattr(registry, "class_count_problem", lambda outputs, classes: None)
    publish_model(plant.fh, version, seed=version, n_outputs=n_outputs, broken=broken)

    deployment = deploy(plant.fh, version, [EDGE])
    row = wait_deploy_done(plant.fh, deployment, EDGE)
    assert row["deploy_stage"] == "failed"
    assert row["deploy_reason"].startswith("smoke_test_failed"), row
    assert row["serving"] == "inspect:1"
    _assert_still_serving_v1(plant)


def test_image_still_being_written_is_not_lost(plant: Plant) -> None:
    """A camera (or `cp`) writes a large image in pieces; the watcher must not give up on it."""
    pixels = np.random.default_rng(7).integers(0, 255, (768, 768), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    data = buffer.getvalue()
    inbox = plant.fh.inbox(EDGE)
    with (inbox / "slow-camera.png").open("wb") as handle:
        handle.write(data[: len(data) // 2])
        handle.flush()
        # The writer stalls for a few watcher scans (the camera's pace, not a wait for state).
        threading.Event().wait(0.5)
        handle.write(data[len(data) // 2 :])
    failed = inbox / "failed" / "slow-camera.png"
    wait_until(
        lambda: (
            failed.exists()
            or plant.fh.row("SELECT 1 AS x FROM predictions WHERE source='file:slow-camera.png'")
        ),
        15,
        "the image to be scored (or given up on)",
    )
    assert not failed.exists(), "the watcher moved an image that was still being written to failed/"
    assert prediction_for(plant.fh, EDGE, "file:slow-camera.png")["model"] == "inspect:1"


# ---------------------------------------------------------------- forged configuration


def test_forged_config_is_rejected_and_threshold_kept(plant: Plant) -> None:
    manager_key = plant.fh.home.signing_key()
    attacker = SigningKey.generate()
    wanted = EdgeConfig(FLEET, EDGE, version=50, default_threshold=0.05)
    payload = codec.encode(wanted)

    envelope = json.loads(manager_key.sign(wanted))
    tampered = json.dumps({**envelope, "payload": payload.decode().replace("0.05", "0.06")})
    with_manager_key_id = json.dumps(
        {**json.loads(attacker.sign(wanted)), "key_id": manager_key.public.key_id}
    )
    forgeries = {
        "signed by a key that is not pinned": attacker.sign(wanted),
        "the manager's key id on the attacker's signature": with_manager_key_id.encode(),
        "payload changed after signing": tampered.encode(),
    }
    topic = topics.down(FLEET, EDGE, topics.Down.CONFIG)
    for i, (what, forged) in enumerate(forgeries.items(), start=1):
        assert plant.service.mqtt.publish_and_wait(
            topic, forged, qos=1, retain=True, timeout_s=5
        ), what
        wait_until(
            lambda: plant.counter("config.rejected.bad_signature"),
            15,
            f"the agent to reject a config {what}",
            expect=partial(eq, i),
        )
        row = wait_until(
            lambda: plant.fh.edge_row(EDGE),
            15,
            f"the manager to hear that the agent rejected a config {what}",
            expect=lambda r: str(r.get("config_status")).startswith("rejected"),
        )
        assert "bad_signature" in row["config_reason"], row
        assert row["config_applied"] == plant.config_version
        status = plant.status()
        assert (status["config_version"], status["threshold"]) == (
            plant.config_version,
            THRESHOLD,
        ), what
        _assert_still_serving_v1(plant)
        assert plant.score_one()["config_version"] == plant.config_version

    # The manager's next genuine document replaces the forged retained one.
    plant.config_version = set_threshold(plant.fh, EDGE, THRESHOLD)
    wait_config_applied(plant.fh, EDGE, plant.config_version)


# ---------------------------------------------------------------- broker isolation


def test_edge_credentials_are_confined_to_the_edge(fleet_home: FleetHome) -> None:
    fh = fleet_home
    settings = fh.settings
    workdir = fh.home.root / "broker"
    # Another fleet on the same broker: its retained documents persist across the restart.
    other = MosquittoBroker(
        workdir,
        FleetAccess("plant-b", "manager-b", "secret-b", {"st-09": "pw-9"}),
        fh.broker().port,
    )
    other.start()
    broker = fh.broker()
    clients: list[RawClient] = []
    try:
        other_manager = RawClient(other.port, "manager-b", "secret-b")
        clients.append(other_manager)
        other_manager.wait_connected()
        for topic in ("fedge/v1/plant-b/st-09/down/config", "fedge/v1/plant-b/st-01/down/config"):
            assert other_manager.publish(topic, b"plant-b secret", retain=True) < 0x80
        other_manager.close()
        other.stop()  # SIGTERM: mosquitto writes its persistence file on the way out
        persisted = (workdir / "data" / "mosquitto.db").read_bytes()
        assert b"fedge/v1/plant-b/st-01/down/config" in persisted

        broker.start()
        manager = fh.client(broker.port, settings.manager_user)
        st01 = fh.client(broker.port, "st-01")
        st02 = fh.client(broker.port, "st-02")
        clients += [manager, st01, st02]
        for client in (manager, st01, st02):
            client.wait_connected()

        up = "fedge/v1/plant-a/+/up/+"
        assert manager.subscribe(up) == [1]
        assert st02.subscribe(topics.edge_subscription(FLEET, "st-02")) == [1]
        # st-01 asks for everything it can name; the broker may grant, but must not deliver.
        for pattern in (
            "fedge/v1/plant-a/st-02/down/+",
            "fedge/v1/plant-a/st-02/#",
            "fedge/v1/plant-a/+/up/+",
            "fedge/v1/plant-b/#",
            "#",
        ):
            codes = st01.subscribe(pattern)
            assert len(codes) == 1
        assert st01.subscribe(topics.edge_subscription(FLEET, "st-01")) == [1]

        # Writing outside its own up/ topics is refused with "not authorized" (0x87).
        forbidden = {
            topics.up(FLEET, "st-02", topics.Up.TELEMETRY): b"{}",
            topics.up(FLEET, "st-02", topics.Up.STATE): b"{}",
            topics.down(FLEET, "st-02", topics.Down.CONFIG): b"{}",
            topics.down(FLEET, "st-01", topics.Down.CONFIG): b"self-issued config",
            "fedge/v1/plant-b/st-09/up/state": b"{}",
            "fedge/v1/plant-b/st-01/up/state": b"{}",
            "elsewhere/topic": b"{}",
        }
        for topic, payload in forbidden.items():
            assert st01.publish(topic, payload) >= 0x80, topic

        # Traffic of st-02 in both directions, and a document for st-01 as the last marker.
        assert st02.publish(topics.up(FLEET, "st-02", topics.Up.TELEMETRY), b"st-02 up") < 0x80
        assert (
            manager.publish(topics.down(FLEET, "st-02", topics.Down.CONFIG), b"st-02 down") < 0x80
        )
        wait_until(lambda: st02.received("fedge/v1/plant-a/st-02/down/"), 10, "st-02's own doc")
        wait_until(lambda: manager.received("fedge/v1/plant-a/st-02/up/"), 10, "st-02's report")
        assert manager.publish(topics.down(FLEET, "st-01", topics.Down.DEPLOY), b"marker") < 0x80
        wait_until(
            lambda: st01.received("fedge/v1/plant-a/st-01/down/deploy"), 10, "st-01's own doc"
        )
        assert [
            m for m in st01.messages if not m[0].startswith("fedge/v1/plant-a/st-01/down/")
        ] == []
        # Nothing st-01 tried to write reached the manager.
        assert [t for t, _ in manager.messages] == ["fedge/v1/plant-a/st-02/up/telemetry"]

        # st-01 cannot take st-02's session by choosing its client id: the username wins.
        impostor = fh.client(broker.port, "st-01", client_id="st-02")
        clients.append(impostor)
        impostor.wait_connected()
        assert (
            manager.publish(topics.down(FLEET, "st-02", topics.Down.DEPLOY), b"still mine") < 0x80
        )
        wait_until(
            lambda: st02.received("fedge/v1/plant-a/st-02/down/deploy"), 10, "st-02 to stay on"
        )
        assert st02.disconnects == 0

        # A client without a certificate (even naming st-01) does not get in at all.
        refused(broker.port, ca_only=fh.home.pki().ca_path, client_id="st-01")
    finally:
        for client in clients:
            client.close()
        other.stop()
        broker.stop()

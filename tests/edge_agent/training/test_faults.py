"""Each fault that keeps a station's SuperNode off the SuperLink names its real cause
(issue 27), produced by the real fault against a real SuperLink (TLS, node
authentication, the fleet's front) and real ``flower-supernode`` processes:

- a SuperNode SIGKILLed and restarted rejoins at once (the front releases its node,
  which Flower would otherwise keep "active" and refuse for about a minute);
- a revoked key: "does not know this station's key", not a certificate;
- a CA that does not verify the SuperLink: TLS, naming the CA;
- nothing listening at the address: the network, not TLS.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home, wait_until

from fedge.aggregator.superlink.link import SuperLink, node_public_key
from fedge.edge_agent.training.causes import current_section
from fedge.edge_agent.training.supervisor import SupernodeSpec, SupernodeSupervisor, kill_tree
from fedge.protocols.fleet_ca import FleetCA
from fedge.transport.ports import free_port

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02", "st-03", "st-04")


@dataclass
class Plant:
    fh: FleetHome
    link: SuperLink
    root: Path


@pytest.fixture(scope="module")
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    root = tmp_path_factory.mktemp("faults")
    fh = make_fleet_home(root, edges=EDGES)
    settings = fh.home.settings()
    link = SuperLink(
        root / "superlink",
        "127.0.0.1",
        settings.superlink_port,
        tls=fh.home.pki().server_files("superlink"),
    )
    link.start()
    try:
        for edge in ("st-01", "st-02", "st-03"):
            link.authorize(edge, node_public_key(fh.tls_files(edge).cert.read_bytes()))
        yield Plant(fh, link, root)
    finally:
        link.stop()
        fh.close()


def spec(plant: Plant, edge: str, *, superlink: str = "", ca: Path | None = None) -> SupernodeSpec:
    files = plant.fh.tls_files(edge)
    return SupernodeSpec(
        superlink or plant.link.address,
        edge,
        plant.fh.data_dir(edge),
        20,
        1,
        60.0,
        root_certificates=ca or files.ca,
        auth_key=files.key,
    )


def section(supervisor: SupernodeSupervisor) -> str:
    return current_section(supervisor.log_file.read_text(errors="replace"))


def connected(supervisor: SupernodeSupervisor) -> bool:
    return "SuperNode ID:" in section(supervisor)


def running(plant: Plant, edge: str, **kwargs: object) -> SupernodeSupervisor:
    supervisor = SupernodeSupervisor(plant.root / edge / "supernode")
    supervisor.start()
    supervisor.apply(spec(plant, edge, **kwargs))  # type: ignore[arg-type]
    return supervisor


def test_a_supernode_killed_and_restarted_rejoins_at_once(plant: Plant) -> None:
    supervisor = running(plant, "st-01")
    try:
        wait_until(lambda: connected(supervisor), 60, "st-01's first activation")
        pid = supervisor.status()["pid"]
        assert isinstance(pid, int)
        killed_at = time.monotonic()
        kill_tree(pid)  # SIGKILL: no DeactivateNode, Flower keeps the node online ~60 s
        wait_until(lambda: supervisor.starts >= 2 and connected(supervisor), 45, "the rejoin")
        rejoined_s = time.monotonic() - killed_at
    finally:
        supervisor.stop()
    front = plant.link.front
    assert front is not None
    assert front.counters["activation.reclaimed"] >= 1
    assert "[code: 2004]" not in supervisor.log_file.read_text()
    # Flower alone refuses the node until 60 s after its last heartbeat.
    assert rejoined_s < 30, rejoined_s


def test_a_revoked_key_is_named_as_such(plant: Plant) -> None:
    supervisor = running(plant, "st-02")
    try:
        wait_until(lambda: connected(supervisor), 60, "st-02's activation")
        plant.link.revoke("st-02")  # what the manager's key sync does on revocation
        wait_until(
            lambda: supervisor.status()["last_cause"],
            90,
            "the refusal named",
            expect=lambda cause: cause == "key-not-registered",
        )
        error = supervisor.last_error
    finally:
        supervisor.stop()
    assert "does not know this station's key" in error and "revoked" in error, error
    assert "TLS" not in error and "network" not in error, error


def test_a_ca_that_does_not_verify_the_superlink_is_named(plant: Plant) -> None:
    other = FleetCA.create("plant-b")
    ca = plant.root / "plant-b-ca.crt"
    ca.write_bytes(other.cert_pem)
    supervisor = running(plant, "st-03", ca=ca)
    try:
        wait_until(
            lambda: supervisor.status()["last_cause"], 60, "the TLS failure named",
            expect=lambda cause: cause == "tls",
        )  # fmt: skip
        error = supervisor.last_error
    finally:
        supervisor.stop()
    assert "does not verify against this station's fleet CA" in error, error
    assert "not registered" not in error and "revoked" not in error, error


def test_nothing_listening_is_a_network_fault_not_a_certificate(plant: Plant) -> None:
    closed = f"127.0.0.1:{free_port()}"
    supervisor = running(plant, "st-01", superlink=closed)
    try:
        wait_until(
            lambda: supervisor.status()["last_cause"], 60, "the network fault named",
            expect=lambda cause: cause == "network",
        )  # fmt: skip
        error = supervisor.last_error
        assert supervisor.status()["running"]  # Flower keeps retrying: so does the station
    finally:
        supervisor.stop()
    assert "nothing listens on the port" in error and closed in error, error
    assert "certificate" not in error.replace("not a certificate problem", ""), error

"""Mutual TLS at the broker (issue 13), against a real Mosquitto run from a manager home.

Who is refused: no certificate, another CA's, an expired one, a revoked one. What a
certificate may do: a station writes only its own up/ topics and reads only its own down/
topics; an operator's certificate reads and cannot pass for the manager.
"""

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, RawClient, make_fleet_home, refused, wait_until

from fedge.edge_manager.security.enrollment import revoke
from fedge.edge_manager.security.operators import add_operator
from fedge.protocols import pki, topics
from fedge.protocols.fleet_ca import FleetCA
from fedge.protocols.pki import Role, TlsFiles
from fedge.transport.broker import MosquittoBroker
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import MqttSettings

pytestmark = pytest.mark.integration

FLEET = "plant-a"
NOT_AUTHORIZED = 0x87


@pytest.fixture
def tls_fleet(tmp_path: Path) -> Iterator[tuple[FleetHome, MosquittoBroker]]:
    fh = make_fleet_home(tmp_path, edges=("st-01", "st-02"), fleet=FLEET)
    broker = fh.broker()
    broker.start()
    try:
        yield fh, broker
    finally:
        broker.stop()
        fh.close()


def station_files(fh: FleetHome, edge: str) -> TlsFiles:
    files = fh.agent_settings(edge).tls()
    assert files is not None
    return files


def write_client(folder: Path, name: str, cert: bytes, key: bytes, ca: Path) -> TlsFiles:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.crt").write_bytes(cert)
    pki.write_private(folder / f"{name}.key", key)
    return TlsFiles(ca=ca, cert=folder / f"{name}.crt", key=folder / f"{name}.key")


def test_a_station_with_its_certificate_connects_without_any_password(
    tls_fleet: tuple[FleetHome, MosquittoBroker],
) -> None:
    fh, broker = tls_fleet
    config = fh.agents["st-01"].read_text()
    assert "password" not in config and "insecure" not in config
    assert (fh.home.root / "broker" / "passwd").exists() is False
    client = RawClient(broker.port, "", "", client_id="st-01", tls=station_files(fh, "st-01"))
    try:
        client.wait_connected()
    finally:
        client.close()


def test_no_certificate_another_ca_and_expired_are_refused(
    tls_fleet: tuple[FleetHome, MosquittoBroker], tmp_path: Path
) -> None:
    fh, broker = tls_fleet
    ca_path = fh.home.pki().ca_path
    refused(broker.port, ca_only=ca_path)

    stranger = FleetCA.create(FLEET)  # same fleet name, another CA
    cert, key = stranger.issue_client("st-01", Role.EDGE)
    refused(broker.port, tls=write_client(tmp_path / "stranger", "st-01", cert, key, ca_path))

    past = pki.utcnow() - dt.timedelta(days=30)
    cert, key = fh.home.pki().ca().issue_client("st-01", Role.EDGE, days=1, now=past)
    refused(broker.port, tls=write_client(tmp_path / "expired", "st-01", cert, key, ca_path))
    assert "certificate verify failed" in broker.log_path.read_text()


def test_a_revoked_station_is_refused_and_its_open_session_goes_deaf_and_mute(
    tls_fleet: tuple[FleetHome, MosquittoBroker],
) -> None:
    fh, broker = tls_fleet
    manager = RawClient(
        broker.port, "", "", client_id="fedge-manager", tls=fh.home.pki().manager_files()
    )
    open_session = RawClient(broker.port, "", "", client_id="st-02", tls=station_files(fh, "st-02"))
    try:
        manager.wait_connected()
        open_session.wait_connected()
        up = f"{topics.edge_root(FLEET, 'st-02')}/up/telemetry"
        assert manager.subscribe(f"{topics.ROOT}/{FLEET}/+/up/+") == [1]
        assert open_session.publish(up, b"before") == 0
        wait_until(lambda: manager.received(up), 10, "the message before revocation")

        revoked = revoke(fh.home, "st-02")
        assert [c.identity for c in revoked] == ["st-02"]
        # The broker re-reads its ACL and CRL on SIGHUP (asynchronously): the session
        # still open can no longer publish (nor receive)...
        wait_until(
            lambda: open_session.publish(up, b"after") == NOT_AUTHORIZED, 10, "the ACL reload"
        )
        # ...and a new connection is refused (a probe accepted before the reload would
        # take the open session over: same identity, same client id, hence this order).
        refused(broker.port, tls=station_files(fh, "st-02"))
        assert "certificate verify failed" in broker.log_path.read_text()
        assert open_session.publish(up, b"mute") == NOT_AUTHORIZED
        # The other station is untouched, and its message after the refusal arrives while
        # the refused one never does.
        other = RawClient(broker.port, "", "", client_id="st-01", tls=station_files(fh, "st-01"))
        other.wait_connected()
        other_up = f"{topics.edge_root(FLEET, 'st-01')}/up/telemetry"
        assert other.publish(other_up, b"marker") == 0
        wait_until(lambda: manager.received(other_up), 10, "st-01's marker")
        other.close()
        assert b"mute" not in [p for _, p in manager.received(up)]
    finally:
        manager.close()
        open_session.close()


def test_a_station_writes_and_reads_only_its_own_topics(
    tls_fleet: tuple[FleetHome, MosquittoBroker],
) -> None:
    fh, broker = tls_fleet
    st1 = RawClient(broker.port, "", "", client_id="st-01", tls=station_files(fh, "st-01"))
    manager = RawClient(
        broker.port, "", "", client_id="fedge-manager", tls=fh.home.pki().manager_files()
    )
    try:
        st1.wait_connected()
        manager.wait_connected()
        other_up = f"{topics.edge_root(FLEET, 'st-02')}/up/telemetry"
        other_down = f"{topics.edge_root(FLEET, 'st-02')}/down/config"
        assert st1.publish(other_up, b"forged") == NOT_AUTHORIZED
        assert st1.publish(f"{topics.edge_root(FLEET, 'st-01')}/down/config", b"x") == (
            NOT_AUTHORIZED
        )
        st1.subscribe(other_down)  # granted or not, nothing of st-02's may arrive
        assert manager.publish(other_down, b"for st-02 only") == 0
        own_down = f"{topics.edge_root(FLEET, 'st-01')}/down/config"
        st1.subscribe(own_down)
        assert manager.publish(own_down, b"for st-01") == 0
        wait_until(lambda: st1.received(own_down), 10, "st-01's own document")
        assert st1.received(other_down) == []
    finally:
        st1.close()
        manager.close()


def test_an_operator_certificate_reads_but_cannot_pass_for_the_manager(
    tls_fleet: tuple[FleetHome, MosquittoBroker],
) -> None:
    fh, broker = tls_fleet
    credential = add_operator(fh.home, "alice")
    assert credential.tls is not None and credential.password == ""
    manager = RawClient(
        broker.port, "", "", client_id="fedge-manager", tls=fh.home.pki().manager_files()
    )
    manager.wait_connected()
    # Asking for the manager's client id with alice's certificate: the broker names the
    # session after the certificate, so the manager's session is not taken over...
    found = wait_until(
        lambda: _connected(broker.port, credential.tls), 10, "alice's connection (ACL reload)"
    )
    assert found is not None
    alice = found
    try:
        down = f"{topics.edge_root(FLEET, 'st-01')}/down/config"
        assert alice.publish(down, b"forged config") == NOT_AUTHORIZED
        assert manager.disconnects == 0
        up = f"{topics.edge_root(FLEET, 'st-01')}/up/telemetry"
        alice.subscribe(up)
        station = RawClient(broker.port, "", "", client_id="st-01", tls=station_files(fh, "st-01"))
        station.wait_connected()
        assert station.publish(up, b"reading") == 0
        wait_until(lambda: alice.received(up), 10, "alice reads the fleet")
        station.close()
    finally:
        alice.close()
        manager.close()


def _connected(port: int, tls: TlsFiles | None) -> RawClient | None:
    client = RawClient(port, "", "", client_id="fedge-manager", tls=tls)
    deadline = time.monotonic() + 5
    while client.connect_code is None and not client.error and time.monotonic() < deadline:
        time.sleep(0.05)
    if client.connect_code == 0:
        return client
    client.close()
    return None


def test_a_session_refused_in_the_tls_handshake_says_so(
    tls_fleet: tuple[FleetHome, MosquittoBroker], tmp_path: Path
) -> None:
    """A certificate refused in the handshake gets no CONNACK: the session still counts
    and reports it as a refusal (an operator must act), not as silence."""
    fh, broker = tls_fleet
    stranger = FleetCA.create(FLEET)
    cert, key = stranger.issue_client("st-01", Role.EDGE)
    files = write_client(tmp_path / "stranger", "st-01", cert, key, fh.home.pki().ca_path)
    session = MqttSession(MqttSettings("127.0.0.1", broker.port, "st-01", tls=files))
    session.start()
    try:
        wait_until(lambda: session.link.failures, 10, "the refusal to be noted")
        assert not session.connected.is_set()
        # The broker's TLS alert names the refusal (issue 27): a certificate problem, said
        # as one, where a closed socket alone would not be blamed on the certificate.
        assert "refused this station's certificate" in session.link.last_error, (
            session.link.last_error
        )
    finally:
        session.stop()


def test_a_station_trusting_another_ca_is_told_the_broker_does_not_verify(
    tls_fleet: tuple[FleetHome, MosquittoBroker], tmp_path: Path
) -> None:
    """A wrong CA file at the station (issue 27): the broker's certificate fails to
    verify on the station's side, and the session says so, naming the CA, not the network."""
    fh, broker = tls_fleet
    other_ca = FleetCA.create("plant-b")
    (tmp_path / "other-ca.crt").write_bytes(other_ca.cert_pem)
    own = station_files(fh, "st-01")
    files = TlsFiles(ca=tmp_path / "other-ca.crt", cert=own.cert, key=own.key)
    session = MqttSession(MqttSettings("127.0.0.1", broker.port, "st-01", tls=files))
    session.start()
    try:
        wait_until(lambda: session.link.failures, 10, "the failure to be noted")
        error = session.link.last_error
        assert "does not verify against this station's fleet CA" in error, error
        assert "CERTIFICATE_VERIFY_FAILED" in error and "network" not in error
    finally:
        session.stop()


def test_a_revoked_station_hears_its_certificate_was_refused_not_a_network_fault(
    tls_fleet: tuple[FleetHome, MosquittoBroker],
) -> None:
    fh, broker = tls_fleet
    revoke(fh.home, "st-02")
    refused(broker.port, tls=station_files(fh, "st-02"))  # the broker re-read its CRL
    session = MqttSession(
        MqttSettings("127.0.0.1", broker.port, "st-02", tls=station_files(fh, "st-02"))
    )
    session.start()
    try:
        wait_until(lambda: session.link.failures, 10, "the refusal to be noted")
        error = session.link.last_error
        assert "TLS:" in error and "network" not in error, error
    finally:
        session.stop()

"""Renewing a station's certificate before it expires, without downtime (issue 13).

Real HTTPS enrollment endpoint, real Mosquitto with mutual TLS and a CRL.
"""

import datetime as dt
import socket
import ssl
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home, wait_until

from fedge.edge_agent.identity.renewal import (
    CertificateRenewer,
    RenewalError,
    complete_pending,
    confirm_certificate,
    current,
    renew_certificate,
    renewal_due,
)
from fedge.edge_agent.viewing.server import ImageServer, StationImages
from fedge.edge_manager.security import credentials
from fedge.edge_manager.security.enroll_server import EnrollServer
from fedge.edge_manager.security.enrollment import revoke
from fedge.edge_manager.viewing.client import fetch_image
from fedge.protocols import codec, pki
from fedge.protocols.config import EdgeConfig
from fedge.protocols.enrollment import RenewRequest
from fedge.protocols.fleet_ca import FleetCA
from fedge.protocols.pki import Role, TlsFiles
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import MqttSettings

EDGE = "st-01"


@pytest.fixture
def station(tmp_path: Path) -> Iterator[tuple[FleetHome, EnrollServer, TlsFiles]]:
    fh = make_fleet_home(tmp_path, edges=(EDGE, "st-02"))
    server = EnrollServer(fh.home, "127.0.0.1", 0)
    server.start()
    tls = fh.tls_files(EDGE)
    # Its certificate has 10 of its 90 days left: due for renewal.
    ca = fh.home.pki().ca()
    past = pki.utcnow() - dt.timedelta(days=80)
    cert, key = ca.issue_client(EDGE, Role.EDGE, days=90, now=past)
    credentials.record_certificate(fh.db, pki.cert_info(pki.load_certificate(cert)))
    pki.write_private(tls.key, key)
    tls.cert.write_bytes(cert)
    try:
        yield fh, server, tls
    finally:
        server.stop()
        fh.close()


def url(server: EnrollServer) -> str:
    return f"https://127.0.0.1:{server.port}"


def test_renewal_is_due_once_a_third_of_the_life_is_left() -> None:
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    info = pki.CertInfo("st-01", Role.EDGE, 1, start, start + dt.timedelta(days=90), "x")
    assert not renewal_due(info, start + dt.timedelta(days=59))
    assert renewal_due(info, start + dt.timedelta(days=61))


@pytest.mark.integration
def test_a_station_renews_with_a_new_key_and_keeps_its_connection(
    station: tuple[FleetHome, EnrollServer, TlsFiles],
) -> None:
    fh, server, tls = station
    broker = fh.broker()
    broker.start()
    session = MqttSession(MqttSettings("127.0.0.1", broker.port, EDGE, tls=tls))
    try:
        session.start()
        wait_until(session.connected.is_set, 10, "the station's connection")
        old = current(tls)
        old_key = tls.key.read_bytes()
        renewer = CertificateRenewer(url(server), tls, session.reload_certificate)
        assert renewer.check() is True and renewer.renewed == 1
        new = current(tls)
        assert new.serial != old.serial and tls.key.read_bytes() != old_key
        assert new.not_after > old.not_after + dt.timedelta(days=60)
        assert renewer.check() is False  # not due any more
        # No downtime: the connection made with the old certificate carries on.
        assert session.connected.is_set() and session.link.failures == 0
        # The station confirmed its new certificate: the old one is revoked at once (a thief
        # holding the old key can neither connect nor renew with it), not after a grace.
        assert server.counters["confirmed"] >= 1 and renewer.confirm_pending is False
        held = {c.serial: c for c in credentials.certificates(fh.db, EDGE)}
        assert held[old.serial].revoked and not held[new.serial].revoked
        assert old.serial in {r.serial for r in credentials.revoked(fh.db)}
        # The broker restarts: the station reconnects, which it can only do with the new
        # certificate.
        broker.stop()
        wait_until(lambda: not session.connected.is_set(), 10, "the station to see it gone")
        broker.start()
        wait_until(session.connected.is_set, 15, "the station to reconnect (new certificate)")
        assert server.counters["renewed"] == 1
        assert not list(tls.key.parent.glob("*.next"))
    finally:
        session.stop()
        broker.stop()


@pytest.mark.integration
def test_renewal_refused_without_a_certificate_when_revoked_or_for_another_name(
    station: tuple[FleetHome, EnrollServer, TlsFiles], tmp_path: Path
) -> None:
    fh, server, tls = station
    _, csr = pki.new_key_and_csr(EDGE)
    assert _post(server, csr, None) == 401  # no client certificate
    _, other_csr = pki.new_key_and_csr("st-02")
    assert _post(server, other_csr, tls) == 403  # a CSR for st-02 with st-01's certificate
    operator_cert, operator_key = fh.home.pki().ca().issue_client("ops", Role.OPERATOR)
    operator = TlsFiles(tls.ca, tmp_path / "ops.crt", tmp_path / "ops.key")
    operator.cert.write_bytes(operator_cert)
    pki.write_private(operator.key, operator_key)
    _, ops_csr = pki.new_key_and_csr("ops")
    assert _post(server, ops_csr, operator) == 403  # only stations renew
    before = len(credentials.certificates(fh.db))
    revoke(fh.home, EDGE)
    with pytest.raises(RenewalError, match="revoked"):
        renew_certificate(url(server), tls)
    assert len(credentials.certificates(fh.db)) == before  # nothing issued
    assert server.counters["refused_no_certificate"] == 1
    assert server.counters["refused_bad_csr"] == 1
    assert server.counters["refused_not_an_edge"] == 1
    assert server.counters["refused_revoked"] == 1


def test_a_swap_interrupted_by_a_crash_is_completed_at_start(tmp_path: Path) -> None:
    ca = FleetCA.create("plant-a")
    tls = TlsFiles(tmp_path / "ca.crt", tmp_path / "agent.crt", tmp_path / "agent.key")
    old_cert, old_key = ca.issue_client(EDGE, Role.EDGE)
    new_cert, new_key = ca.issue_client(EDGE, Role.EDGE)
    for name, data in (("agent.crt", old_cert), ("agent.key", old_key)):
        (tmp_path / name).write_bytes(data)
    # Crashed after the key moved, before the certificate did.
    (tmp_path / "agent.key").write_bytes(new_key)
    (tmp_path / "agent.crt.next").write_bytes(new_cert)
    assert complete_pending(tls) is True
    assert tls.cert.read_bytes() == new_cert and tls.key.read_bytes() == new_key
    # Crashed with both new files written: both move.
    (tmp_path / "agent.key.next").write_bytes(old_key)
    (tmp_path / "agent.crt.next").write_bytes(old_cert)
    assert complete_pending(tls) is True
    assert tls.cert.read_bytes() == old_cert and tls.key.read_bytes() == old_key
    assert complete_pending(tls) is False


def _post(server: EnrollServer, csr: bytes, tls: TlsFiles | None) -> int:
    context = ssl.create_default_context(cafile=str(server.home.pki().ca_path))
    if tls is not None:
        context.load_cert_chain(str(tls.cert), str(tls.key))
    request = urllib.request.Request(
        f"{url(server)}/v1/renew",
        data=codec.encode(RenewRequest(csr.decode())),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _copy(tls: TlsFiles, folder: Path) -> TlsFiles:
    folder.mkdir()
    copy = TlsFiles(tls.ca, folder / "edge.crt", folder / "edge.key")
    copy.cert.write_bytes(tls.cert.read_bytes())
    pki.write_private(copy.key, tls.key.read_bytes())
    return copy


@pytest.mark.integration
def test_a_thief_with_an_old_key_cannot_renew_once_the_station_confirmed(
    station: tuple[FleetHome, EnrollServer, TlsFiles], tmp_path: Path
) -> None:
    """Review of issue 24: within the grace a lost answer needs, an old key used to renew
    took the station over. Confirming the swap revokes the old certificate at once."""
    fh, server, tls = station
    stolen = _copy(tls, tmp_path / "stolen")  # the thief copied the key before renewal
    renewer = CertificateRenewer(url(server), tls, lambda: None)
    assert renewer.check() is True and renewer.confirm_pending is False
    issued = len(credentials.certificates(fh.db, EDGE))
    with pytest.raises(RenewalError, match="revoked"):
        renew_certificate(url(server), stolen)
    assert len(credentials.certificates(fh.db, EDGE)) == issued  # nothing issued to it


@pytest.mark.integration
def test_a_renewal_by_an_old_key_before_the_confirmation_is_caught(
    station: tuple[FleetHome, EnrollServer, TlsFiles], tmp_path: Path
) -> None:
    """The thief renews first (between the station's renewal and its confirmation): the
    station's confirmation is refused, says why, and revokes nothing."""
    fh, server, tls = station
    stolen = _copy(tls, tmp_path / "stolen")
    renew_certificate(url(server), tls)  # the station's renewal; its confirm not yet sent
    renew_certificate(url(server), stolen)  # the thief's, with the old key
    live_before = [c.serial for c in credentials.certificates(fh.db, EDGE) if not c.revoked]
    with pytest.raises(RenewalError, match="newer certificate"):
        confirm_certificate(url(server), tls)
    live_after = [c.serial for c in credentials.certificates(fh.db, EDGE) if not c.revoked]
    assert live_after == live_before
    assert server.counters["refused_not_newest"] == 1


@pytest.mark.integration
def test_the_stations_tls_endpoint_serves_its_renewed_certificate_without_a_restart(
    station: tuple[FleetHome, EnrollServer, TlsFiles], tmp_path: Path
) -> None:
    """The station's image endpoint (mutual TLS, transport/metrics.ServerTlsContext)
    presents the certificate the station's renewal wrote at the next handshake."""
    fh, server, tls = station
    image = tmp_path / "p-1.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    images = StationImages(
        config=lambda: EdgeConfig(
            fleet=fh.settings.fleet, edge=EDGE, version=2, operator_viewing=True
        ),
        known=lambda pid: pid == "p-1",
        kept=lambda pid: (image, image.stat().st_size) if pid == "p-1" else None,
        counters=Counter(),
    )
    endpoint = ImageServer(images, tls, "127.0.0.1", 0)
    endpoint.start()
    manager = fh.home.pki().manager_files()
    try:
        old = current(tls)
        assert _served_serial(endpoint.address, manager) == old.serial
        renew_certificate(url(server), tls)
        new = current(tls)
        assert new.serial != old.serial
        assert _served_serial(endpoint.address, manager) == new.serial
        # The manager's own client checks the station's (renewed) certificate and fetches.
        fetched = fetch_image(manager, EDGE, endpoint.address, "p-1", timeout_s=5.0)
        assert fetched.data == image.read_bytes()
    finally:
        endpoint.stop()


def _served_serial(address: str, client: TlsFiles) -> int:
    host, port = address.rsplit(":", 1)
    # Only reads what is presented: a station's certificate is of client purpose, which
    # OpenSSL's server check refuses (the manager's client checks it by hand, viewing/).
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(str(client.cert), str(client.key))
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        context.wrap_socket(raw) as connection,
    ):
        der = connection.getpeercert(binary_form=True)
    assert der is not None
    return pki.load_certificate(ssl.DER_cert_to_PEM_cert(der).encode()).serial_number

"""A renewed certificate is served by the metrics endpoint without a restart (issue 27).

``manager serve`` with metrics off loopback (so over mutual TLS), a real Mosquitto, and
the credential keeper renewing serve's certificate as it does when one has a third of
its life left: the next TLS scrape gets the new certificate, by serial, and the metrics.
"""

import dataclasses
import datetime as dt
import http.client
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home, wait_until
from cryptography import x509

from fedge.edge_manager.security import credentials
from fedge.edge_manager.serve import ManagerService
from fedge.protocols import pki
from fedge.protocols.pki import TlsFiles

pytestmark = pytest.mark.integration

# Not loopback as serve reads it (127.0.0.1, ::1, localhost), so served over mutual TLS;
# still this machine.
METRICS_HOST = "127.0.0.2"


def _client(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(files.ca))
    context.check_hostname = False  # the certificate names the manager's hosts
    context.load_cert_chain(str(files.cert), str(files.key))
    return context


def served_serial(port: int, client: TlsFiles) -> int:
    with (
        socket.create_connection((METRICS_HOST, port), timeout=5) as raw,
        _client(client).wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def scrape(port: int, client: TlsFiles) -> tuple[int, int, bytes]:
    """GET /metrics over TLS: status, the served certificate's serial, the body."""
    connection = http.client.HTTPSConnection(
        METRICS_HOST, port, context=_client(client), timeout=10
    )
    try:
        connection.request("GET", "/metrics")
        assert isinstance(connection.sock, ssl.SSLSocket)
        der = connection.sock.getpeercert(binary_form=True)
        assert der is not None
        response = connection.getresponse()
        return response.status, x509.load_der_x509_certificate(der).serial_number, response.read()
    finally:
        connection.close()


def file_serial(path: Path) -> int:
    return pki.load_certificate(path.read_bytes()).serial_number


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    home = make_fleet_home(tmp_path, edges=("st-01",))
    home.home.save_settings(dataclasses.replace(home.settings, metrics_host=METRICS_HOST))
    yield home
    home.close()


def test_serve_metrics_present_the_renewed_certificate_without_a_restart(fh: FleetHome) -> None:
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    try:
        service.start()
        wait_until(service.mqtt.connected.is_set, 20, "the manager's connection")
        assert service.metrics_server is not None and service.metrics_server.tls
        port = service.metrics_server.port
        fleet_pki = fh.home.pki()
        served = fleet_pki.server_files("grpc")
        status, first, body = scrape(port, fleet_pki.manager_files())
        assert (status, first) == (200, file_serial(served.cert))
        assert b"fedge_" in body
        # The home's certificates issued again as if made 600 days ago (825-day ones: a
        # third of their life left, so due), then serve's own keeper renews them.
        made = pki.utcnow() - dt.timedelta(days=600)
        ca = fleet_pki.ca()
        fleet_pki.write_crl(ca, lambda: credentials.revoked(fh.db), now=made)
        fleet_pki.issue_servers(ca, fh.settings.server_hosts(), now=made)
        fleet_pki.issue_manager(ca, fh.settings.manager_user, now=made)
        aged = file_serial(served.cert)
        assert served_serial(port, fleet_pki.manager_files()) == aged != first
        renewed = service.credential_keeper.check()
        assert renewed is not None and "grpc" in renewed.servers and renewed.manager
        new = file_serial(served.cert)
        assert new not in (first, aged)
        status, serial, body = scrape(port, fleet_pki.manager_files())
        assert (status, serial) == (200, new)
        assert b"fedge_" in body
        assert service.metrics_server.port == port  # the same server, never restarted
    finally:
        service.stop()
        broker.stop()

"""The metrics endpoint over mutual TLS: the fleet CA's certificate is not enough, the
holder must be an operator's tool or the manager (a station's certificate is from the
same CA, and the metrics describe the whole fleet); a revoked one is refused at once."""

import http.client
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home
from prometheus_client import CollectorRegistry

from fedge.protocols.pki import TlsFiles
from fedge.transport.metrics import MetricsServer, Readiness, mutual_tls_context

pytestmark = pytest.mark.integration  # a server on a socket


def _get(port: int, client: TlsFiles, ca: Path) -> int:
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(client.cert), str(client.key))
    context.check_hostname = False  # the server certificate names the manager's hosts
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[FleetHome]:
    fh = make_fleet_home(tmp_path, edges=("st-01",))
    yield fh
    fh.close()


def test_only_operators_and_the_manager_read_metrics_over_tls(fleet: FleetHome) -> None:
    pki = fleet.home.pki()
    files = pki.server_files("grpc")
    server = MetricsServer(
        CollectorRegistry(),
        lambda: Readiness({}),
        "127.0.0.1",
        0,
        context=mutual_tls_context(files),
        crl=files.crl,
    )
    server.start()
    try:
        ca = pki.ca_path
        assert _get(server.port, pki.manager_files(), ca) == 200
        assert _get(server.port, fleet.tls_files("st-01"), ca) == 403  # a station's
    finally:
        server.stop()

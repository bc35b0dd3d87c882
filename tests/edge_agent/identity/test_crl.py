"""The fleet's CRL at the station (issue 30): fetched from the manager's real enrollment
endpoint, adopted only when the fleet CA signed it and it is not older, and used by the
station's real image endpoint to refuse a revoked manager's or operator's certificate."""

import datetime as dt
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home

from fedge.edge_agent.identity.crl import StationRevocations, adopt_crl, crl_path
from fedge.edge_agent.identity.renewal import CertificateRenewer
from fedge.edge_agent.viewing.server import ImageServer, StationImages
from fedge.edge_manager.security import credentials
from fedge.edge_manager.security.enroll_server import EnrollServer
from fedge.edge_manager.security.enrollment import revoke
from fedge.edge_manager.security.operators import add_operator, remove_operator
from fedge.edge_manager.viewing.client import ViewError, fetch_image
from fedge.protocols import pki
from fedge.protocols.config import EdgeConfig
from fedge.protocols.fleet_ca import FleetCA, Revoked
from fedge.protocols.pki import CertificateError, Role, TlsFiles
from fedge.protocols.viewing import Refusal

pytestmark = pytest.mark.integration
EDGE = "st-01"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(128)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[FleetHome, EnrollServer, TlsFiles]]:
    fh = make_fleet_home(tmp_path, edges=(EDGE,))
    server = EnrollServer(fh.home, "127.0.0.1", 0)
    server.start()
    try:
        yield fh, server, fh.tls_files(EDGE)
    finally:
        server.stop()
        fh.close()


def _endpoint(fh: FleetHome, tls: TlsFiles, tmp_path: Path) -> tuple[ImageServer, Counter[str]]:
    image = tmp_path / "p-1.png"
    image.write_bytes(PNG)
    counters: Counter[str] = Counter()
    images = StationImages(
        config=lambda: EdgeConfig(
            fleet=fh.settings.fleet, edge=EDGE, version=2, operator_viewing=True
        ),
        known=lambda pid: pid == "p-1",
        kept=lambda pid: (image, image.stat().st_size) if pid == "p-1" else None,
        counters=counters,
        revoked=StationRevocations(crl_path(tls), tls.ca).revoked,
    )
    server = ImageServer(images, tls, "127.0.0.1", 0)
    server.start()
    return server, counters


def _refused(files: TlsFiles, address: str) -> Refusal | None:
    with pytest.raises(ViewError) as caught:
        fetch_image(files, EDGE, address, "p-1", timeout_s=5.0)
    return caught.value.refusal


def test_a_revoked_manager_or_operator_is_refused_at_the_station_once_it_has_the_crl(
    fleet: tuple[FleetHome, EnrollServer, TlsFiles], tmp_path: Path
) -> None:
    fh, enroll, tls = fleet
    home = fh.home
    # A manager certificate of before a key compromise, and an operator removed since.
    cert, key = home.pki().ca().issue_client("manager-old", Role.MANAGER)
    old_manager = home.pki().write_client("manager-old", cert, key)
    credentials.record_certificate(fh.db, pki.cert_info(pki.load_certificate(cert)), pem=cert)
    operator = add_operator(home, "lena").tls
    assert operator is not None
    endpoint, counters = _endpoint(fh, tls, tmp_path)
    try:
        # Before any revocation the old manager certificate is served.
        assert fetch_image(old_manager, EDGE, endpoint.address, "p-1").data == PNG
        revoke(home, "manager-old")
        remove_operator(home, "lena")
        renewer = CertificateRenewer(f"https://127.0.0.1:{enroll.port}", tls, lambda: None)
        renewer.refresh_crl()  # what every renewal check does
        assert (renewer.crl_updates, renewer.crl_failures) == (1, 0)
        assert enroll.counters["crl_served"] == 1
        assert crl_path(tls).read_bytes() == home.pki().crl_path.read_bytes()
        assert _refused(old_manager, endpoint.address) is Refusal.REVOKED
        assert _refused(operator, endpoint.address) is Refusal.REVOKED
        assert counters["images.refused.revoked"] == 2
        # The manager's current certificate still gets the image.
        manager = home.pki().manager_files()
        assert fetch_image(manager, EDGE, endpoint.address, "p-1").data == PNG
        assert counters["images.sent"] == 2
        renewer.refresh_crl()  # the same list again: nothing to adopt
        assert (renewer.crl_updates, renewer.crl_failures) == (1, 0)
    finally:
        endpoint.stop()


def test_a_crl_not_of_the_fleet_ca_or_older_is_not_adopted_and_a_broken_one_admits_nobody(
    fleet: tuple[FleetHome, EnrollServer, TlsFiles], tmp_path: Path
) -> None:
    fh, _, tls = fleet
    ca = fh.home.pki().ca()
    now = pki.utcnow()
    assert adopt_crl(tls, ca.crl([], now=now)) is True
    held = crl_path(tls).read_bytes()
    with pytest.raises(CertificateError, match="before the one held"):
        adopt_crl(tls, ca.crl([], now=now - dt.timedelta(hours=1)))  # a replayed old list
    stranger = FleetCA.create("elsewhere").crl([Revoked(1, now)])
    with pytest.raises(CertificateError, match="not signed by this station's fleet CA"):
        adopt_crl(tls, stranger)
    assert crl_path(tls).read_bytes() == held
    endpoint, counters = _endpoint(fh, tls, tmp_path)
    try:
        manager = fh.home.pki().manager_files()
        assert fetch_image(manager, EDGE, endpoint.address, "p-1").data == PNG
        crl_path(tls).write_bytes(stranger)  # tampered on disk
        assert _refused(manager, endpoint.address) is Refusal.REVOKED
        assert counters["images.crl_unusable"] == 1
        assert counters["images.refused.revoked"] == 1
    finally:
        endpoint.stop()

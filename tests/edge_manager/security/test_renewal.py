"""Credentials that never lapse by themselves (issue 24, item 4): the pure decisions,
then real homes (real certificates, real SQLite) whose credentials were issued by a clock
moved back, then real Mosquitto with mutual TLS and a CRL, and real gRPC.

The clock is injected, never waited on: a home "made 400 days ago" is one whose CA, CRL
and certificates were issued with ``now`` 400 days back, and the manager's check runs at
the real now. Mosquitto checks the CRL's next-update against the real clock, so what it
refuses or admits here is what a fleet would see after a year.
"""

import datetime as dt
import shutil
import socket
import ssl
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from conftest import FleetHome, make_fleet_home, mqtt_outcome, refused, wait_until
from cryptography import x509

from fedge.edge_manager.security import credentials
from fedge.edge_manager.security.enrollment import renew as renew_station
from fedge.edge_manager.security.pki import PASSPHRASE_ENV, SERVERS
from fedge.edge_manager.security.renewal import (
    REPLACED_GRACE,
    Credential,
    CredentialKeeper,
    Kind,
    Renewed,
    StationCert,
    due,
    home_credentials,
    renew,
    replaced,
)
from fedge.edge_manager.serve import ManagerService
from fedge.protocols import pki
from fedge.protocols.enrollment import RenewRequest
from fedge.protocols.pki import TlsFiles
from fedge.transport.broker import MosquittoBroker
from fedge.transport.grpc.tls import ServerFiles
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import MqttSettings

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)
EDGES = ("st-01", "st-02")


def cred(kind: Kind, start: dt.datetime, days: float) -> Credential:
    return Credential(kind, str(kind), start, start + days * DAY)


# ---------------------------------------------------------------- pure decisions


def test_a_credential_is_due_once_less_than_a_third_of_its_validity_is_left() -> None:
    crl = cred(Kind.CRL, T0, 365)
    assert not due(crl, T0)
    assert not due(crl, T0 + 243 * DAY)  # 122 days left: still more than a third
    assert due(crl, T0 + 244 * DAY)
    assert due(crl, T0 + 400 * DAY)  # past its next-update
    server = cred(Kind.SERVER, T0, 825)
    assert not due(server, T0 + 400 * DAY)  # 425 of 825 days left
    assert not due(server, T0 + 549 * DAY)
    assert due(server, T0 + 551 * DAY)
    unreadable = Credential(Kind.SERVER, "grpc", None, None, "missing")
    assert due(unreadable, T0) and unreadable.days_left(T0) is None
    assert cred(Kind.MANAGER, T0, 825).days_left(T0 + 25 * DAY) == pytest.approx(800)
    with pytest.raises(ValueError, match="without a problem"):
        Credential(Kind.CRL, "crl", None, T0)


def test_a_replaced_station_certificate_is_revoked_only_after_the_grace() -> None:
    old = StationCert("st-01", 1, T0, T0 + 90 * DAY)
    new = StationCert("st-01", 2, T0 + 60 * DAY, T0 + 150 * DAY)
    other = StationCert("st-02", 3, T0 + 1 * DAY, T0 + 91 * DAY)
    certs = [old, new, other]
    # Within the grace the station may not have its new certificate yet (a lost answer):
    # it must still connect, and renew, with the old one.
    assert replaced(certs, T0 + 60 * DAY) == []
    assert replaced(certs, T0 + 60 * DAY + REPLACED_GRACE - dt.timedelta(seconds=1)) == []
    assert replaced(certs, T0 + 60 * DAY + REPLACED_GRACE) == [1]
    # A renewal retried after a lost answer: the newest restarts the grace, and every
    # older certificate goes once it has passed.
    retried = StationCert("st-01", 4, T0 + 61 * DAY, T0 + 151 * DAY)
    assert replaced([*certs, retried], T0 + 67 * DAY + 23 * dt.timedelta(hours=1)) == []
    assert replaced([*certs, retried], T0 + 68 * DAY) == [1, 2]
    # Revoked already, or expired (its dates refuse it): left alone.
    revoked_old = StationCert("st-01", 1, T0, T0 + 90 * DAY, revoked=True)
    assert replaced([revoked_old, new], T0 + 80 * DAY) == []
    assert replaced(certs, T0 + 91 * DAY) == []
    assert replaced([old, new], T0 + 80 * DAY, grace=dt.timedelta(0)) == [1]


# ---------------------------------------------------------------- real homes, moved clock


def age_home(fh: FleetHome, days: float) -> dt.datetime:
    """Issue the home's CA, CRL, server and manager certificates again as if it had been
    made ``days`` ago (the stations keep their current certificates: they renew
    themselves); return that moment."""
    made = pki.utcnow() - days * DAY
    fleet_pki = fh.home.pki()
    settings = fh.settings
    ca = fleet_pki.ca()
    fleet_pki.write_crl(ca, lambda: credentials.revoked(fh.db), now=made)
    fleet_pki.issue_servers(ca, settings.server_hosts(), now=made)
    fleet_pki.issue_manager(ca, settings.manager_user, now=made)
    return made


def crl_next_update(fh: FleetHome) -> dt.datetime:
    crl = x509.load_pem_x509_crl(fh.home.pki().crl_path.read_bytes())
    assert crl.next_update_utc is not None
    return crl.next_update_utc


def not_after(path: Path) -> dt.datetime:
    return pki.load_certificate(path.read_bytes()).not_valid_after_utc


@pytest.fixture
def fh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetHome]:
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    home = make_fleet_home(tmp_path, edges=EDGES)
    yield home
    home.close()


def test_a_fresh_home_has_nothing_due(fh: FleetHome) -> None:
    now = pki.utcnow()
    held = home_credentials(fh.home)
    assert {(c.kind, c.name) for c in held} == {
        (Kind.CRL, "crl"),
        *((Kind.SERVER, name) for name in SERVERS),
        (Kind.MANAGER, "manager"),
    }
    before = fh.home.pki().crl_path.read_bytes()
    assert renew(fh.home, now) == Renewed()
    assert fh.home.pki().crl_path.read_bytes() == before


def test_after_400_days_the_crl_is_issued_again_with_every_revocation(fh: FleetHome) -> None:
    made = age_home(fh, 400)
    revoked = credentials.revoke(fh.db, "st-02")  # listed before and after
    fh.home.pki().write_crl(fh.home.pki().ca(), lambda: credentials.revoked(fh.db), now=made)
    servers_before = {n: not_after(fh.home.pki().server_files(n).cert) for n in SERVERS}
    now = pki.utcnow()
    assert crl_next_update(fh) < now  # lapsed: Mosquitto would refuse every station
    renewed = renew(fh.home, now)
    # 425 of the servers' 825 days are left: not due yet.
    assert renewed == Renewed(crl=True)
    assert crl_next_update(fh) > now + 300 * DAY
    listed = pki.revoked_serials(fh.home.pki().crl_path.read_bytes())
    assert listed == {c.serial for c in revoked}
    assert servers_before == {n: not_after(fh.home.pki().server_files(n).cert) for n in SERVERS}
    assert renew(fh.home, now) == Renewed()  # done: the next check finds nothing due


def test_after_600_days_server_and_manager_certificates_are_renewed_for_their_names(
    fh: FleetHome,
) -> None:
    # The console's certificate names its own bind host: kept when renewed.
    fleet_pki = fh.home.pki()
    fleet_pki.served_files("console", [*fh.settings.server_hosts(), "console.plant.example"])
    age_home(fh, 600)
    now = pki.utcnow()
    renewed = renew(fh.home, now)
    assert renewed.crl and renewed.manager and renewed.revoked == ()
    assert set(renewed.servers) == {*SERVERS, "console"}
    for name in renewed.servers:
        files = fleet_pki.server_files(name)
        assert not_after(files.cert) > now + 800 * DAY
        assert pki.cert_info(pki.load_certificate(files.cert.read_bytes())).identity == name
    assert fleet_pki.served_files(
        "console", [*fh.settings.server_hosts(), "console.plant.example"]
    ) == fleet_pki.server_files("console")
    console = fleet_pki.server_files("console").cert.read_bytes()
    assert (
        b"console.plant.example"
        in pki.load_certificate(console)
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value.public_bytes()
    )
    assert not_after(fleet_pki.manager_files().cert) > now + 800 * DAY


def test_a_check_that_cannot_open_the_ca_is_counted_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSPHRASE_ENV, "correct horse battery staple")
    home = make_fleet_home(tmp_path, edges=("st-01",))
    try:
        age_home(home, 400)
        before = home.home.pki().crl_path.read_bytes()
        monkeypatch.delenv(PASSPHRASE_ENV)  # serve started without it
        keeper = CredentialKeeper(home.home)
        assert keeper.check() is None
        assert keeper.counters["credentials.renewal_failed"] == 1
        assert home.home.pki().crl_path.read_bytes() == before
        monkeypatch.setenv(PASSPHRASE_ENV, "correct horse battery staple")
        renewed = keeper.check()
        assert renewed is not None and renewed.crl
        assert keeper.counters["credentials.crl_issued"] == 1
    finally:
        home.close()


def test_an_insecure_home_has_no_credentials_to_renew(tmp_path: Path) -> None:
    home = make_fleet_home(tmp_path, edges=("st-01",), insecure=True)
    try:
        assert home_credentials(home.home) == []
        assert renew(home.home, pki.utcnow() + 4000 * DAY) == Renewed()
    finally:
        home.close()


# ---------------------------------------------------------------- real processes


def station_session(fh: FleetHome, edge: str, port: int) -> MqttSession:
    tls = fh.tls_files(edge)
    return MqttSession(MqttSettings("127.0.0.1", port, edge, tls=tls))


def served_serial(port: int, client: TlsFiles, alpn: list[str] | None = None) -> int:
    """The serial of the certificate a TLS server presents now (a fresh handshake)."""
    context = ssl.create_default_context(cafile=str(client.ca))
    context.check_hostname = False
    context.load_cert_chain(str(client.cert), str(client.key))
    if alpn:
        context.set_alpn_protocols(alpn)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def file_serial(path: Path) -> int:
    return pki.load_certificate(path.read_bytes()).serial_number


@pytest.mark.integration
@pytest.mark.parametrize("days", [400, 700])
def test_the_clock_moved_past_a_year_every_station_stays_connected(
    fh: FleetHome, days: int
) -> None:
    """The home was made ``days`` ago; nothing was revoked since, so its CRL was never
    issued again. Real Mosquitto refuses every station; `manager serve`'s credential
    check renews, the broker reloads on SIGHUP, and the manager and every station
    connect (the 700-day home also gets new broker, gRPC and manager certificates, which
    the running broker and gRPC server present without a restart)."""
    age_home(fh, days)
    broker: MosquittoBroker = fh.broker()
    broker.start()
    service: ManagerService | None = None
    sessions: list[MqttSession] = []
    try:
        # Without renewal: the lapsed CRL locks the fleet out.
        for edge in EDGES:
            refused(broker.port, tls=fh.tls_files(edge))
        # (OpenSSL says only "certificate verify failed"; the CRL is all that lapsed:
        # the station certificates are current, the servers' are valid for months.)
        assert "certificate verify failed" in broker.log_path.read_text()
        old_broker_serial = served_serial(broker.port, fh.tls_files("st-01"))
        # `manager serve` with its clock: the check at start renews what is due.
        service = ManagerService(fh.home, clock=pki.utcnow)
        service.start()
        wait_until(service.mqtt.connected.is_set, 20, "the manager's own connection")
        assert service.counters["credentials.crl_issued"] == 1
        for edge in EDGES:
            session = station_session(fh, edge, broker.port)
            sessions.append(session)
            session.start()
        for session in sessions:
            wait_until(session.connected.is_set, 20, f"{session.settings.client_id} to connect")
        renewed_servers = service.counters["credentials.servers_renewed"]
        if days == 400:
            assert renewed_servers == 0 and service.counters["credentials.manager_renewed"] == 0
            assert served_serial(broker.port, fh.tls_files("st-01")) == old_broker_serial
        else:
            assert renewed_servers == len(SERVERS)
            assert service.counters["credentials.manager_renewed"] == 1
            pki_files = fh.home.pki()
            # Mosquitto and gRPC present their new certificates: no restart.
            wait_until(
                lambda: served_serial(broker.port, fh.tls_files("st-01")),
                10,
                "the broker's renewed certificate",
                expect=lambda s: s == file_serial(pki_files.server_files("broker").cert),
            )
            assert service.grpc_port is not None
            assert served_serial(service.grpc_port, fh.tls_files("st-01"), ["h2"]) == (
                file_serial(pki_files.server_files("grpc").cert)
            )
        assert service.mqtt.connected.is_set()
    finally:
        for session in sessions:
            session.stop()
        if service is not None:
            service.stop()
        broker.stop()


@pytest.mark.integration
def test_a_running_grpc_server_presents_its_renewed_certificate(fh: FleetHome) -> None:
    """Real gRPC (BoringSSL): the server's certificate files are read again at the first
    handshake after they change; a pair caught half written keeps the current one."""
    fleet_pki = fh.home.pki()
    files = fleet_pki.server_files("grpc")
    fetcher = ServerFiles(files)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_secure_port(
        "127.0.0.1:0",
        grpc.dynamic_ssl_server_credentials(
            fetcher.initial,
            fetcher,  # type: ignore[arg-type]
            require_client_authentication=True,
        ),
    )
    server.start()
    station = fh.tls_files("st-01")
    try:
        first = served_serial(port, station, ["h2"])
        assert first == file_serial(files.cert)
        # Half written: a new key beside the old certificate.
        files.key.write_bytes(pki.key_pem(pki.new_key()))
        assert served_serial(port, station, ["h2"]) == first
        fleet_pki.issue_server(fleet_pki.ca(), "grpc", fh.settings.server_hosts())
        renewed = served_serial(port, station, ["h2"])
        assert renewed == file_serial(files.cert) != first
        assert fetcher.reloads == 1
    finally:
        server.stop(grace=None)


@pytest.mark.integration
def test_a_renewed_stations_old_certificate_is_refused_by_the_broker(
    fh: FleetHome, tmp_path: Path
) -> None:
    """st-01 renews (the real renew path); its new certificate works at once and its
    old one too while the grace lasts (the station may not have the new one yet); after
    the grace the manager's check revokes the old one and the broker refuses it, while
    the station, with its new certificate, stays connected."""
    broker = fh.broker()
    broker.start()
    current = fh.tls_files("st-01")
    old = TlsFiles(current.ca, tmp_path / "old.crt", tmp_path / "old.key")
    shutil.copy(current.cert, old.cert)
    shutil.copy(current.key, old.key)
    key_pem, csr_pem = pki.new_key_and_csr("st-01")
    response = renew_station(fh.home, old.cert.read_bytes(), RenewRequest(csr_pem.decode()))
    pki.write_private(current.key, key_pem)
    current.cert.write_text(response.certificate)
    session = station_session(fh, "st-01", broker.port)
    moved = [pki.utcnow()]
    keeper = CredentialKeeper(fh.home, clock=lambda: moved[0])
    try:
        assert keeper.check() == Renewed()  # within the grace: the old one still works
        # (probed before the station connects: the broker's client id is the certificate's
        # name, so an accepted probe would take the station's session over)
        assert mqtt_outcome(broker.port, tls=old) == "accepted"
        session.start()
        wait_until(session.connected.is_set, 15, "st-01 with its new certificate")
        # The grace has passed. (The clock for the CRL stays the real one: Mosquitto
        # refuses a CRL issued in its future; the grace is the keeper's parameter.)
        keeper.grace = dt.timedelta(0)
        renewed = keeper.check()
        assert renewed is not None and renewed.crl
        assert renewed.revoked == (file_serial(old.cert),)
        refused(broker.port, tls=old)
        assert session.connected.is_set()
        # Its next connection (the broker restarted) is with the new certificate.
        broker.stop()
        wait_until(lambda: not session.connected.is_set(), 10, "st-01 to see the broker go")
        broker.start()
        wait_until(session.connected.is_set, 20, "st-01 to reconnect with its new certificate")
        edge_state = fh.edge_row("st-01").get("state")
        assert edge_state != "revoked"  # the station stays enrolled
    finally:
        session.stop()
        broker.stop()

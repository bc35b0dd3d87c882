"""Enrolling an edge: a one-time token, a certificate for the key made on the device, its
broker identity and the agent.toml it runs with; and revoking one (issue 13).

Under mutual TLS (the default) an edge is its certificate: `fedge edge enroll st-01`
issues a short-lived single-use token; the device (`fedge agent enroll`) makes its key,
sends a CSR with the token to the enrollment endpoint (`manager serve`), and gets its
certificate (:func:`redeem`). On one machine (the demo, tests) :func:`enroll` does both
halves through the same :func:`redeem`, writing the key straight into the device's folder.
A ``--insecure`` home keeps the development path: a password per edge, plain TCP.
"""

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security import credentials, key_rotation
from fedge.edge_manager.store import Store
from fedge.privacy.floor import default_floor, floor_toml
from fedge.protocols import pki, validate
from fedge.protocols.enrollment import EnrollRequest, EnrollResponse, JoinToken, RenewRequest
from fedge.protocols.errors import ProtocolError
from fedge.protocols.fleet_ca import FleetCA
from fedge.protocols.pki import Role, TlsFiles
from fedge.transport.broker import FleetAccess, MosquittoBroker

AGENT_KEY, AGENT_CERT, AGENT_CA = "agent.key", "agent.crt", "ca.crt"


def fleet_access(home: ManagerHome) -> FleetAccess:
    settings = home.settings()
    if settings.insecure:
        return FleetAccess(
            fleet=settings.fleet,
            manager_user=settings.manager_user,
            manager_password=home.manager_password(),
            edge_passwords=home.edge_passwords(),
            operator_passwords={
                name: str(account["password"]) for name, account in home.operator_accounts().items()
            },
        )
    # Under TLS the ACL names every identity holding a valid certificate; a revoked one
    # drops out of it, so its open session can neither publish nor receive (the CRL
    # refuses its next connection).
    store = Store(home.db_path)
    try:
        issued = [c for c in credentials.certificates(store) if not c.revoked]
    finally:
        store.close()
    return FleetAccess(
        fleet=settings.fleet,
        manager_user=settings.manager_user,
        manager_password="",
        edge_passwords={},
        edges=frozenset(c.identity for c in issued if c.role == Role.EDGE.value),
        operators=frozenset(c.identity for c in issued if c.role == Role.OPERATOR.value),
    )


def managed_broker(home: ManagerHome) -> MosquittoBroker:
    """The Mosquitto this home runs (``fedge manager broker``), on the configured port."""
    settings = home.settings()
    tls = None if settings.insecure else home.pki().server_files("broker")
    return MosquittoBroker(
        home.root / "broker",
        fleet_access(home),
        settings.broker_port,
        tls=tls,
        host=settings.broker_host,
        persistence=home.broker_persistence_dir,
    )


def reload_broker(home: ManagerHome) -> None:
    """Rewrite the broker's ACL (and passwords) and make a running broker re-read them
    and the CRL."""
    broker = managed_broker(home)
    if broker.workdir.exists():
        broker.reload_running()


def agent_toml(
    home: ManagerHome,
    edge: str,
    data_dir: Path,
    *,
    tls: TlsFiles | None = None,
    password: str = "",
    privacy_floor: bool = True,
) -> str:
    """The agent's config, with the addresses agents reach the manager at (advertised).

    With the station's default privacy floor (issue 24) unless ``privacy_floor`` is False
    (an explicit opt-out, written as such). The floor is the device's local setting: the
    manager writes it here only because the device's folder is on this machine."""
    settings = home.settings()
    public_key = home.public_key_path.read_text().strip()
    credential = (
        ["insecure = true", f'password = "{password}"']
        if tls is None
        else [f'ca_file = "{tls.ca}"', f'cert_file = "{tls.cert}"', f'key_file = "{tls.key}"']
    )
    return "\n".join(
        [
            f'fleet = "{settings.fleet}"',
            f'edge = "{edge}"',
            f'data_dir = "{data_dir}"',
            f'broker_host = "{settings.agent_broker_host}"',
            f"broker_port = {settings.broker_port}",
            *credential,
            f'grpc_target = "{settings.agent_grpc_target}"',
            f'superlink = "{settings.agent_superlink}"',
            *([] if tls is None else [f'enroll_url = "{settings.enroll_url}"']),
            f'manager_public_key = "{public_key}"',
            *_root_toml(home),
            f'watch_dir = "{data_dir / "inbox"}"',
            "http_port = 0",
            *floor_toml(default_floor(5000) if privacy_floor else None),
            "",
        ]
    )


def _root_toml(home: ManagerHome) -> list[str]:
    """The fleet's root key for a station to pin (issue 24), if the fleet has one."""
    root = _root_text(home)
    return [] if root is None else [f'manager_root_key = "{root}"']


def _check_edge_name(home: ManagerHome, edge: str) -> None:
    settings = home.settings()
    # An agent given a wildcard (0.0.0.0) could never connect: refused before any secret.
    problem = settings.agent_address_problem()
    if problem is not None:
        raise ManagerError(f"cannot enrol {edge}: {problem}")
    # Broker users share one namespace (the username is the client id).
    if edge == settings.manager_user:
        raise ManagerError(f"{edge!r} is the manager's own broker user; pick another edge id")
    if edge in home.operator_accounts() or edge in _operator_certs(home):
        raise ManagerError(f"{edge!r} is an operator's name; pick another edge id")


def _operator_certs(home: ManagerHome) -> set[str]:
    store = Store(home.db_path)
    try:
        return {c.identity for c in credentials.certificates(store) if c.role == "operator"}
    finally:
        store.close()


@dataclass(frozen=True)
class Invitation:
    """What a person carries to the device: the token (with the CA pin) and where to go."""

    edge: str
    token: JoinToken
    url: str
    expires_in_s: float

    def command(self) -> str:
        """The device's command; it asks for the token (kept off its command line)."""
        return f"fedge agent enroll --manager {self.url} --edge {self.edge} --config agent.toml"


def invite(home: ManagerHome, edge: str, *, ttl_s: float = credentials.TOKEN_TTL_S) -> Invitation:
    """A single-use token for ``edge`` (only its hash is stored)."""
    if home.settings().insecure:
        raise ManagerError(
            "this home is --insecure (passwords, plain TCP): enrol with --out instead of a token"
        )
    try:
        validate.identifier(edge, "edge")
    except ProtocolError as exc:
        raise ManagerError(str(exc)) from None
    _check_edge_name(home, edge)
    fingerprint = home.pki().ca_fingerprint().removeprefix("sha256:")
    store = Store(home.db_path)
    try:
        secret = credentials.create_token(store, edge, ttl_s=ttl_s)
    finally:
        store.close()
    return Invitation(edge, JoinToken(secret, fingerprint), home.settings().enroll_url, ttl_s)


def _response(home: ManagerHome, edge: str, certificate: bytes) -> EnrollResponse:
    settings = home.settings()
    return EnrollResponse(
        fleet=settings.fleet,
        edge=edge,
        certificate=certificate.decode(),
        ca=home.pki().ca_path.read_text(),
        manager_public_key=home.public_key_path.read_text().strip(),
        broker_host=settings.agent_broker_host,
        broker_port=settings.broker_port,
        grpc_target=settings.agent_grpc_target,
        superlink=settings.agent_superlink,
        manager_root_key=_root_text(home),
    )


def _root_text(home: ManagerHome) -> str | None:
    root = key_rotation.fleet_root(home)
    return None if root is None else root.to_text()


def _station_certificate(ca: FleetCA, pem: bytes, what: str) -> pki.CertInfo:
    """The station certificate a TLS peer presented, checked against the fleet CA."""
    try:
        info = ca.verify(pem)
    except pki.CertificateError as exc:
        raise credentials.EnrollmentError(str(exc), "bad_certificate") from None
    if info.role is not Role.EDGE:
        raise credentials.EnrollmentError(f"only stations {what} here", "not_an_edge")
    return info


def _held_and_live(store: Store, info: pki.CertInfo) -> list[credentials.IssuedCert]:
    """The station's unrevoked certificates; refused unless ``info`` is one of them."""
    held = credentials.certificates(store, info.identity)
    mine = next((c for c in held if c.serial == info.serial), None)
    if mine is None or mine.revoked:
        raise credentials.EnrollmentError(
            f"the certificate of {info.identity!r} is revoked or unknown; enrol again",
            "revoked",
        )
    return [c for c in held if not c.revoked]


def renew(home: ManagerHome, current_pem: bytes, request: RenewRequest) -> EnrollResponse:
    """A new certificate for the station holding ``current_pem`` (its TLS peer
    certificate), for the key in its CSR. Refused unless the current certificate is this
    CA's, valid, an edge's, issued by this manager and not revoked, and the CSR names the
    same edge. The old certificate stays valid for a grace: connections made with it
    carry on (renewal without downtime), and a station that lost this answer renews
    again with it; `manager serve` revokes it once the grace has passed
    (credential_renewal.REPLACED_GRACE)."""
    ca = home.pki().ca()
    info = _station_certificate(ca, current_pem, "renew")
    store = Store(home.db_path)
    try:
        _held_and_live(store, info)
        try:
            cert = ca.sign_csr(request.csr.encode(), identity=info.identity, role=Role.EDGE)
        except pki.CertificateError as exc:
            raise credentials.EnrollmentError(str(exc), "bad_csr") from None
        credentials.record_certificate(store, pki.cert_info(pki.load_certificate(cert)), pem=cert)
    finally:
        store.close()
    return _response(home, info.identity, cert)


def confirm(home: ManagerHome, current_pem: bytes, *, at: float | None = None) -> list[int]:
    """A station says it holds its newest certificate (``current_pem``, its TLS peer
    certificate, after a renewal's swap): every older certificate of it is revoked now,
    not after the grace a lost answer needs, so a thief holding an old key can neither
    connect nor renew with it. Returns the serials revoked. Refused (nothing changes)
    unless the certificate is this CA's, an edge's, not revoked and that edge's newest."""
    ca = home.pki().ca()
    info = _station_certificate(ca, current_pem, "confirm")
    store = Store(home.db_path)
    try:
        live = _held_and_live(store, info)
        if max(live, key=lambda c: (c.issued_at, c.serial)).serial != info.serial:
            # A newer certificate exists that this station did not confirm: it was issued
            # to whoever renewed with an older key. Nothing is revoked; an operator looks.
            raise credentials.EnrollmentError(
                f"{info.identity!r} has a newer certificate than the one confirming: was an "
                "old key of this station used to renew? Revoke the station and enrol it "
                "again if it was not this station",
                "not_newest",
            )
        older = [c.serial for c in live if c.serial != info.serial]
        if older:
            credentials.revoke_replaced(store, older, at=time.time() if at is None else at)
            home.pki().write_crl(ca, lambda: credentials.revoked(store))
    finally:
        store.close()
    if older:
        reload_broker(home)
    return older


def redeem(home: ManagerHome, request: EnrollRequest) -> EnrollResponse:
    """Sign the device's CSR if its token is good; register the edge and let it on the
    broker. Raises :class:`credentials.EnrollmentError` (nothing issued) otherwise."""
    ca = home.pki().ca()
    issued_pem: list[bytes] = [b""]

    def issue() -> tuple[pki.CertInfo, bytes]:
        try:
            cert = ca.sign_csr(request.csr.encode(), identity=request.edge, role=Role.EDGE)
        except pki.CertificateError as exc:
            raise credentials.EnrollmentError(str(exc), "bad_csr") from None
        issued_pem[0] = cert
        return pki.cert_info(pki.load_certificate(cert)), cert

    fleet = Fleet.open(home)
    try:
        credentials.redeem_token(fleet.store, request.token, request.edge, issue)
        # The edges row (gRPC's insecure-mode token is a random one nobody holds).
        fleet.enroll(request.edge, secrets.token_urlsafe(18))
    finally:
        fleet.store.close()
    reload_broker(home)
    return _response(home, request.edge, issued_pem[0])


def enroll(
    home: ManagerHome,
    fleet: Fleet,
    edge: str,
    data_dir: Path,
    *,
    tls_dir: Path | None = None,
    privacy_floor: bool = True,
) -> str:
    """Enrol ``edge`` whose device folder is on this machine; return its agent.toml.

    Under TLS the key is made in ``tls_dir`` (default: beside ``data_dir``) and only its
    CSR goes through :func:`redeem`, with a token issued for it. A ``--insecure`` home
    gives a password instead (then the agent.toml holds a secret: write it 0600).
    """
    if home.settings().insecure:
        _check_edge_name(home, edge)
        password = home.add_edge_password(edge)
        fleet.enroll(edge, password)
        reload_broker(home)
        return agent_toml(home, edge, data_dir, password=password, privacy_floor=privacy_floor)
    folder = tls_dir if tls_dir is not None else data_dir.parent
    invitation = invite(home, edge)
    key_pem, csr_pem = pki.new_key_and_csr(edge)
    files = TlsFiles(ca=folder / AGENT_CA, cert=folder / AGENT_CERT, key=folder / AGENT_KEY)
    response = redeem(home, EnrollRequest(edge, invitation.token.secret, csr_pem.decode()))
    pki.write_private(files.key, key_pem)
    files.cert.write_text(response.certificate)
    files.ca.write_text(response.ca)
    return agent_toml(home, edge, data_dir, tls=files, privacy_floor=privacy_floor)


def revoke(home: ManagerHome, identity: str) -> list[credentials.IssuedCert]:
    """Revoke every certificate of ``identity``: the CRL is rewritten, the broker re-reads
    it and drops the identity from its ACL, gRPC refuses it at its next call."""
    fleet_pki = home.pki()
    ca = fleet_pki.ca()
    store = Store(home.db_path)
    try:
        revoked_now = credentials.revoke(store, identity)
        if not revoked_now and not credentials.certificates(store, identity):
            raise ManagerError(f"no certificate was issued to {identity!r}")
        fleet_pki.write_crl(ca, lambda: credentials.revoked(store))
    finally:
        store.close()
    reload_broker(home)
    return revoked_now

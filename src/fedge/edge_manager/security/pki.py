"""The fleet CA's files in a manager home, and the server and manager certificates.

<home>/pki/ca.crt                 the fleet CA certificate (what every party pins)
<home>/pki/ca.key                 its key, 0600; encrypted when FEDGE_CA_PASSPHRASE is set
<home>/pki/crl.pem                revoked certificates, rewritten atomically on revocation
                                  and before its next-update (credential_renewal.py)
<home>/pki/servers/<name>.crt|key the broker's, gRPC's, the SuperLink's, enrollment's and
                                  the console's (issued when first served over TLS)
<home>/pki/clients/manager.crt|key the manager's own client certificate (broker user)

Which certificates were issued and revoked is in the manager's store
(:mod:`fedge.edge_manager.security.credentials`); this module only reads and writes files.
"""

import datetime as dt
import fcntl
import ipaddress
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedge.edge_manager.errors import ManagerError
from fedge.protocols import pki
from fedge.protocols.fleet_ca import FleetCA, Revoked
from fedge.protocols.pki import Role, TlsFiles

PASSPHRASE_ENV = "FEDGE_CA_PASSPHRASE"
SERVERS = ("broker", "grpc", "superlink", "enroll")
ON_DEMAND = ("console",)  # issued when first served over TLS (served_files)
RENEW_BEFORE_DAYS = 30  # an on-demand certificate this close to its end is issued again


def passphrase() -> bytes | None:
    """The CA key's passphrase from the environment (never from a file in the home)."""
    value = os.environ.get(PASSPHRASE_ENV, "")
    return value.encode() if value else None


def server_hosts(*hosts: str) -> list[str]:
    """The names a server certificate must carry: loopback, this machine's name, and the
    hosts given (the advertised host, non-wildcard bind hosts)."""
    names = ["127.0.0.1", "localhost", socket.gethostname()]
    for host in hosts:
        bare = host.strip().strip("[]")
        if bare and bare != "*" and not _unspecified(bare) and bare not in names:
            names.append(bare)
    return names


def _unspecified(host: str) -> bool:
    """A wildcard bind address (0.0.0.0, ::, or any spelling of them)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _normal(host: str) -> str:
    """One spelling per host: IP addresses as Python writes them, DNS names lower-case."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()


def covers(cert_path: Path, hosts: Sequence[str]) -> bool:
    """Whether the certificate at ``cert_path`` names every one of ``hosts`` (wildcard
    bind addresses excepted) and this machine's name, as DNS names or IP addresses."""
    cert = pki.load_certificate(cert_path.read_bytes())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    named = {_normal(str(n)) for n in names.get_values_for_type(x509.DNSName)}
    named |= {_normal(str(ip)) for ip in names.get_values_for_type(x509.IPAddress)}
    return {_normal(h) for h in server_hosts(*hosts)} <= named


def usable(files: TlsFiles, now: dt.datetime) -> bool:
    """Whether ``files`` hold a certificate and the key to it, valid for more than
    RENEW_BEFORE_DAYS yet (an expiring one is issued again before it lapses)."""
    if not files.cert.exists() or not files.key.exists():
        return False
    try:
        cert = pki.load_certificate(files.cert.read_bytes())
        key = pki.load_key(files.key.read_bytes())
    except (pki.CertificateError, OSError):
        return False
    if cert.not_valid_after_utc - now < dt.timedelta(days=RENEW_BEFORE_DAYS):
        return False
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return cert.public_key().public_bytes(der, spki) == key.public_key().public_bytes(der, spki)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class FleetPki:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def ca_path(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key_path(self) -> Path:
        return self.root / "ca.key"

    @property
    def crl_path(self) -> Path:
        return self.root / "crl.pem"

    def exists(self) -> bool:
        return self.ca_path.exists() and self.ca_key_path.exists()

    def create(
        self,
        fleet: str,
        hosts: Sequence[str],
        manager_user: str,
        *,
        now: dt.datetime | None = None,
    ) -> FleetCA:
        """A new CA, its empty CRL, server certificates for ``hosts`` and the manager's
        client certificate (``manager_user`` is its broker user name), all issued at
        ``now`` (tests move it)."""
        if self.exists():
            raise ManagerError(f"{self.root} already holds a fleet CA")
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        ca = FleetCA.create(fleet, now=now)
        ca.save(self.ca_path, self.ca_key_path, passphrase())
        self.write_crl(ca, list, now=now)
        self.issue_servers(ca, hosts, now=now)
        self.issue_manager(ca, manager_user, now=now)
        return ca

    def issue_manager(
        self, ca: FleetCA, manager_user: str, *, now: dt.datetime | None = None
    ) -> TlsFiles:
        """(Re)issue the manager's own client certificate (its broker user)."""
        cert, key = ca.issue_client(manager_user, Role.MANAGER, days=pki.SERVER_DAYS, now=now)
        self._write_pair(self.root / "clients" / "manager", cert, key)
        return self.manager_files()

    def ca(self) -> FleetCA:
        if not self.exists():
            raise ManagerError(
                f"{self.root} holds no fleet CA; this home was made with --insecure "
                "(plain listeners), or before certificates existed"
            )
        try:
            return FleetCA.load(self.ca_path, self.ca_key_path, passphrase())
        except pki.CertificateError as exc:
            raise ManagerError(f"cannot open the fleet CA in {self.root}: {exc}") from None

    def ca_fingerprint(self) -> str:
        return pki.fingerprint(pki.load_certificate(self.ca_path.read_bytes()))

    def server_names(self) -> tuple[str, ...]:
        """Every server certificate this home has: SERVERS, and the on-demand ones
        issued so far."""
        issued = [n for n in ON_DEMAND if self.server_files(n).cert.exists()]
        return (*SERVERS, *issued)

    def issue_servers(
        self, ca: FleetCA, hosts: Sequence[str], *, now: dt.datetime | None = None
    ) -> None:
        """(Re)issue every server certificate for ``hosts`` (after `manager advertise`),
        the on-demand ones too where they were issued."""
        for name in self.server_names():
            self.issue_server(ca, name, hosts, now=now)

    def issue_server(
        self, ca: FleetCA, name: str, hosts: Sequence[str], *, now: dt.datetime | None = None
    ) -> TlsFiles:
        """(Re)issue server certificate ``name`` for ``hosts`` (and this machine)."""
        files = self.server_files(name)  # refuses an unknown name
        cert, key = ca.issue_server(name, server_hosts(*hosts), now=now)
        self._write_pair(self.root / "servers" / name, cert, key)
        return files

    def write_crl(
        self,
        ca: FleetCA,
        revoked: Callable[[], Iterable[Revoked]],
        *,
        now: dt.datetime | None = None,
    ) -> None:
        """Issue the CRL listing ``revoked()``, read and written under one lock: a
        revocation written by another process meanwhile (`fedge edge revoke` while serve
        renews the CRL) is never overwritten by a CRL made from an older list."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "crl.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                _atomic_write(self.crl_path, ca.crl(revoked(), now=now))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_pair(self, stem: Path, cert: bytes, key: bytes) -> None:
        stem.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        pki.write_private(stem.with_suffix(".key"), key)
        _atomic_write(stem.with_suffix(".crt"), cert)

    def _files(self, stem: Path, *, crl: bool) -> TlsFiles:
        return TlsFiles(
            ca=self.ca_path,
            cert=stem.with_suffix(".crt"),
            key=stem.with_suffix(".key"),
            crl=self.crl_path if crl else None,
        )

    def server_files(self, name: str) -> TlsFiles:
        if name not in SERVERS + ON_DEMAND:
            known = ", ".join(SERVERS + ON_DEMAND)
            raise ManagerError(f"no server certificate {name!r} (known: {known})")
        return self._files(self.root / "servers" / name, crl=True)

    def served_files(
        self, name: str, hosts: Sequence[str], *, now: dt.datetime | None = None
    ) -> TlsFiles:
        """``name``'s server files, issued first when missing, expiring, not matching
        their key (a write cut short) or not naming every one of ``hosts`` (a home made
        before the console had a certificate, or a console bound to an address the
        others are not reached at)."""
        files = self.server_files(name)
        if not usable(files, now or pki.utcnow()) or not covers(files.cert, hosts):
            cert, key = self.ca().issue_server(name, server_hosts(*hosts))
            self._write_pair(self.root / "servers" / name, cert, key)
        return files

    def manager_files(self) -> TlsFiles:
        return self._files(self.root / "clients" / "manager", crl=False)

    def client_files(self, name: str) -> TlsFiles:
        """A client certificate kept in the home (operators' tools run on this machine)."""
        return self._files(self.root / "clients" / name, crl=False)

    def write_client(self, name: str, cert: bytes, key: bytes) -> TlsFiles:
        self._write_pair(self.root / "clients" / name, cert, key)
        return self.client_files(name)

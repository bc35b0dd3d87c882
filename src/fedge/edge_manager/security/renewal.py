"""Credentials that never lapse by themselves (issue 24, item 4).

A fleet that runs for years must not lock itself out on a date. The manager keeps fresh,
from `manager serve`'s worker (:class:`CredentialKeeper`: at start, then hourly):

- **the CRL** (``pki/crl.pem``): issued again once less than a third of its validity is
  left (365 days: about 122 days before its next-update), and whenever a replaced
  certificate is revoked. Past its next-update Mosquitto's OpenSSL refuses *every*
  station (reproduced in issue 24), so it is not left to the next revocation;
- **the server certificates** (every name in ``fleet_pki.SERVERS`` and the on-demand ones
  issued so far) and **the manager's own client certificate**: issued again once less
  than a third of their validity is left (825 days: about 275 days before they end),
  for the names they carried and this home's hosts;
- **a station's certificate that a renewal replaced**: revoked once the newer one has
  been issued for :data:`REPLACED_GRACE` (7 days). Not at once: the manager cannot see
  that the station received its new certificate (the answer may be lost on the way), and
  a station whose old certificate were revoked first could neither connect nor renew. In
  the grace it retries hourly with the old one (edge_agent/identity/renewal.py) and gets a fresh
  certificate; after it, a thief holding only the old key is refused.

Why "a third left" and not a fixed margin: it is the rule stations apply to their own
certificates (``edge_agent.renewal.RENEW_WHEN_LEFT``), it scales with each lifetime, and
it leaves months to restart a process that cannot reload its certificate.

Who picks up the new files, and how:

- Mosquitto (2.0.11 here) re-reads its ``certfile``/``keyfile`` and ``crlfile`` on
  SIGHUP (man mosquitto.conf; tests/edge_manager/security/test_renewal.py checks it
  against the real broker): the manager signals the broker as it does on revocation
  (:func:`fedge.edge_manager.security.enrollment.reload_broker`); open sessions carry on;
- fedge's gRPC server takes the new certificate at the next handshake after the files
  change (``transport/grpc/tls.py``), and its ``RevocationList`` re-reads the CRL when the
  file changes;
- the manager's own MQTT session presents its new certificate from its next connection
  (``on_manager_renewed``);
- the SuperLink (Flower), the console and the enrollment endpoint read their certificate
  when they start: the renewal is logged with the old certificate's end date, months
  away, by which they must be restarted; `fedge manager doctor` shows the days left.

Server and manager certificates are not revoked when renewed: nothing was compromised,
and a process that cannot reload still presents the old one until restarted.

Decisions are pure functions over frozen dataclasses (:func:`due`, :func:`replaced`);
:func:`home_credentials`, :func:`renew` and :class:`CredentialKeeper` are the adapter.
Time is always passed in (``now``, ``clock``): tests move it by more than a year.
"""

import datetime as dt
import enum
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security import credentials
from fedge.edge_manager.security.enrollment import reload_broker
from fedge.edge_manager.store import Store, StoreError
from fedge.protocols import pki
from fedge.protocols.pki import Role

log = logging.getLogger(__name__)

RENEW_WHEN_LEFT = 1 / 3  # of a credential's validity
REPLACED_GRACE = dt.timedelta(days=7)
CHECK_EVERY_S = 3600.0
# Servers that read their certificate only when they start (see the module docstring),
# and what to restart for each.
RESTART_TO_RELOAD = {
    "superlink": "the SuperLink (`fedge manager superlink`)",
    "console": "the console",
    "enroll": "`fedge manager serve` (its enrollment endpoint)",
}


class Kind(enum.StrEnum):
    CRL = "crl"
    SERVER = "server"
    MANAGER = "manager"


@dataclass(frozen=True)
class Credential:
    """One credential of the home as read from its file: a certificate's validity, or
    the CRL's lastUpdate .. nextUpdate. ``problem`` (dates None) says why it is unusable
    (missing, does not parse); such a credential is due at once."""

    kind: Kind
    name: str
    not_before: dt.datetime | None
    not_after: dt.datetime | None
    problem: str = ""

    def __post_init__(self) -> None:
        if (self.not_before is None or self.not_after is None) and not self.problem:
            raise ValueError(f"{self.kind} {self.name}: dates missing without a problem")

    def days_left(self, now: dt.datetime) -> float | None:
        if self.not_after is None:
            return None
        return (self.not_after - now).total_seconds() / 86400.0


def due(credential: Credential, now: dt.datetime, when_left: float = RENEW_WHEN_LEFT) -> bool:
    """Pure: issue it again? Yes when it is unusable, or less than ``when_left`` of its
    validity is left at ``now`` (expired included)."""
    if credential.not_before is None or credential.not_after is None:
        return True
    life = (credential.not_after - credential.not_before).total_seconds()
    return (credential.not_after - now).total_seconds() < when_left * life


@dataclass(frozen=True)
class StationCert:
    """A station's certificate as recorded in the store."""

    identity: str
    serial: int
    issued_at: dt.datetime
    not_after: dt.datetime
    revoked: bool = False


def replaced(
    certs: Iterable[StationCert], now: dt.datetime, grace: dt.timedelta = REPLACED_GRACE
) -> list[int]:
    """Pure: the serials to revoke because a renewal replaced them. Per station: every
    unrevoked, unexpired certificate issued before its newest one, once that newest one
    has been issued for ``grace`` (so a station that lost the answer to its renewal can
    still renew with the old one). Expired ones are left: their dates refuse them."""
    live = [c for c in certs if not c.revoked and c.not_after > now]
    newest: dict[str, StationCert] = {}
    for cert in live:
        seen = newest.get(cert.identity)
        if seen is None or (cert.issued_at, cert.serial) > (seen.issued_at, seen.serial):
            newest[cert.identity] = cert
    return sorted(
        cert.serial
        for cert in live
        if cert is not newest[cert.identity] and now - newest[cert.identity].issued_at >= grace
    )


@dataclass(frozen=True)
class Renewed:
    """What one check did."""

    crl: bool = False
    servers: tuple[str, ...] = ()
    manager: bool = False
    revoked: tuple[int, ...] = ()  # serials of replaced station certificates

    @property
    def anything(self) -> bool:
        return self.crl or self.manager or bool(self.servers) or bool(self.revoked)


# -- the adapter: reading the home


def _certificate(kind: Kind, name: str, path: Path) -> Credential:
    if not path.is_file():
        return Credential(kind, name, None, None, "missing")
    try:
        cert = pki.load_certificate(path.read_bytes())
    except (pki.CertificateError, OSError) as exc:
        return Credential(kind, name, None, None, str(exc))
    return Credential(kind, name, cert.not_valid_before_utc, cert.not_valid_after_utc)


def _crl(path: Path) -> Credential:
    try:
        crl = x509.load_pem_x509_crl(path.read_bytes())
    except OSError as exc:
        return Credential(Kind.CRL, "crl", None, None, f"cannot be read ({exc.strerror or exc})")
    except ValueError:
        return Credential(Kind.CRL, "crl", None, None, "does not parse as a PEM CRL")
    if crl.next_update_utc is None:
        return Credential(Kind.CRL, "crl", None, None, "has no next-update")
    return Credential(Kind.CRL, "crl", crl.last_update_utc, crl.next_update_utc)


def home_credentials(home: ManagerHome) -> list[Credential]:
    """The CRL, every server certificate and the manager's client certificate of a TLS
    home (none for an --insecure one)."""
    fleet_pki = home.pki()
    if home.settings().insecure or not fleet_pki.exists():
        return []
    found = [_crl(fleet_pki.crl_path)]
    found += [
        _certificate(Kind.SERVER, name, fleet_pki.server_files(name).cert)
        for name in fleet_pki.server_names()
    ]
    found.append(_certificate(Kind.MANAGER, "manager", fleet_pki.manager_files().cert))
    return found


def _station_certs(store: Store) -> list[StationCert]:
    return [
        StationCert(
            c.identity,
            c.serial,
            dt.datetime.fromtimestamp(c.issued_at, dt.UTC),
            dt.datetime.fromtimestamp(c.not_after, dt.UTC),
            c.revoked,
        )
        for c in credentials.certificates(store)
        if c.role == Role.EDGE.value
    ]


def _named_hosts(path: Path) -> list[str]:
    """The DNS names and IP addresses a certificate carries (kept when it is renewed:
    the console's bind host, a host advertised since)."""
    try:
        cert = pki.load_certificate(path.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (pki.CertificateError, OSError, x509.ExtensionNotFound):
        return []
    ips = names.get_values_for_type(x509.IPAddress)
    return [
        *names.get_values_for_type(x509.DNSName),
        *(str(ip) for ip in ips if isinstance(ip, ipaddress.IPv4Address | ipaddress.IPv6Address)),
    ]


# -- the adapter: renewing


def renew(home: ManagerHome, now: dt.datetime, *, grace: dt.timedelta = REPLACED_GRACE) -> Renewed:
    """Issue again what is :func:`due` at ``now`` and revoke what renewals
    :func:`replaced`; writes the files atomically but tells no consumer (see
    :func:`tell_consumers`). Raises ManagerError when the CA cannot be opened (its
    passphrase not given) and StoreError when the store cannot be written; then nothing
    was changed that a later check does not redo."""
    held = home_credentials(home)
    if not held:
        return Renewed()
    fleet_pki = home.pki()
    settings = home.settings()
    store = Store(home.db_path)
    try:
        to_revoke = replaced(_station_certs(store), now, grace)
        stale = [c for c in held if due(c, now)]
        if not to_revoke and not stale:
            return Renewed()
        ca = fleet_pki.ca()
        if to_revoke:
            credentials.revoke_replaced(store, to_revoke, at=now.timestamp())
        crl = bool(to_revoke) or any(c.kind is Kind.CRL for c in stale)
        if crl:
            fleet_pki.write_crl(
                ca, lambda: credentials.revoked(store, now=now.timestamp()), now=now
            )
    finally:
        store.close()
    servers: list[str] = []
    for credential in (c for c in stale if c.kind is Kind.SERVER):
        files = fleet_pki.server_files(credential.name)
        hosts = [*settings.server_hosts(), *_named_hosts(files.cert)]
        fleet_pki.issue_server(ca, credential.name, hosts, now=now)
        servers.append(credential.name)
    manager = any(c.kind is Kind.MANAGER for c in stale)
    if manager:
        fleet_pki.issue_manager(ca, settings.manager_user, now=now)
    return Renewed(crl=crl, servers=tuple(servers), manager=manager, revoked=tuple(to_revoke))


def tell_consumers(
    home: ManagerHome,
    renewed: Renewed,
    held: Sequence[Credential] = (),
    *,
    on_manager_renewed: Callable[[], None] = lambda: None,
) -> None:
    """Make the running consumers use what :func:`renew` wrote: SIGHUP the managed
    broker (CRL, its certificate), reload the manager's own session; log the servers
    that read their certificate only at start (``held``: the credentials before renewal,
    for the old end date)."""
    if renewed.crl or "broker" in renewed.servers:
        reload_broker(home)
    if renewed.manager:
        on_manager_renewed()
    ends = {c.name: c.not_after for c in held if c.kind is Kind.SERVER}
    for name in sorted(set(RESTART_TO_RELOAD) & set(renewed.servers)):
        end = ends.get(name)
        until = f"{end:%Y-%m-%d}" if end is not None else "its old certificate ends"
        log.warning(
            "the %s server certificate was renewed; restart %s before %s so it serves the new one",
            name,
            RESTART_TO_RELOAD[name],
            until,
        )


class CredentialKeeper:
    """Runs :func:`renew` when due (``every_s``, first at once) on the caller's thread:
    `manager serve`'s worker calls :meth:`tick` between batches. ``clock`` says what
    time it is for the credentials (tests move it); the interval is monotonic time.
    A failed check is logged, counted and tried again at the next interval."""

    def __init__(
        self,
        home: ManagerHome,
        *,
        clock: Callable[[], dt.datetime] = pki.utcnow,
        every_s: float = CHECK_EVERY_S,
        grace: dt.timedelta = REPLACED_GRACE,
        on_manager_renewed: Callable[[], None] = lambda: None,
        counters: Counter[str] | None = None,
    ) -> None:
        self.home = home
        self.clock = clock
        self.every_s = every_s
        self.grace = grace
        self.on_manager_renewed = on_manager_renewed
        self.counters: Counter[str] = Counter() if counters is None else counters
        self._next = 0.0

    def tick(self) -> Renewed | None:
        """Check if the interval has passed; None if it has not, or the check failed."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.every_s
        return self.check()

    def check(self) -> Renewed | None:
        """Check now; what was renewed, or None when the check failed."""
        now = self.clock()
        try:
            held = home_credentials(self.home)
            renewed = renew(self.home, now, grace=self.grace)
        except (ManagerError, StoreError, pki.CertificateError, OSError) as exc:
            self.counters["credentials.renewal_failed"] += 1
            log.error(
                "credential renewal failed (%s); retried in %.0f s. If the CA key is "
                "encrypted, start `manager serve` with FEDGE_CA_PASSPHRASE set",
                exc,
                self.every_s,
            )
            return None
        if renewed.anything:
            self._count(renewed)
            log.info(
                "credentials renewed: crl=%s servers=%s manager=%s replaced revoked=%d",
                renewed.crl,
                ",".join(renewed.servers) or "-",
                renewed.manager,
                len(renewed.revoked),
            )
            tell_consumers(self.home, renewed, held, on_manager_renewed=self.on_manager_renewed)
        return renewed

    def _count(self, renewed: Renewed) -> None:
        self.counters["credentials.crl_issued"] += int(renewed.crl)
        self.counters["credentials.servers_renewed"] += len(renewed.servers)
        self.counters["credentials.manager_renewed"] += int(renewed.manager)
        self.counters["credentials.replaced_revoked"] += len(renewed.revoked)

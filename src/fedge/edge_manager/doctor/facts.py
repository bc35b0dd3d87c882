"""What `fedge manager doctor` looks at, gathered from a manager home (the adapter of
:mod:`fedge.edge_manager.doctor.report`).

Reads only: file modes (``stat``), certificates' end dates, the CA key's PEM header (is it
"ENCRYPTED"?), the CRL's serials, the broker's config text and the store's certificate
rows. No key's body is kept in memory longer than one header line or one log chunk, and
nothing read here is ever put into a fact but modes, dates, serials, names and booleans.
"""

import datetime as dt
import stat
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509

from fedge.edge_manager.doctor.keys import SigningKeyFact
from fedge.edge_manager.doctor.report import CertFact, CrlFact, FileMode, HomeFacts, RevokedFact
from fedge.edge_manager.doctor.storage import StorageFact, last_save_failure
from fedge.edge_manager.home import launcher, space
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security import credentials
from fedge.edge_manager.security.key_rotation import trust_view
from fedge.edge_manager.security.pki import SERVERS
from fedge.edge_manager.store import Store
from fedge.protocols import pki

PEM_KEY_MARK = b"PRIVATE KEY-----"
LOG_CHUNK = 1 << 20


def _rel(home: ManagerHome, path: Path) -> str:
    try:
        return str(path.relative_to(home.root))
    except ValueError:
        return str(path)


def _cert_file(home: ManagerHome, subject: str, path: Path) -> CertFact:
    label = f"{subject} ({_rel(home, path)})"
    if not path.is_file():
        return CertFact(label, None, "missing")
    try:
        info = pki.cert_info(pki.load_certificate(path.read_bytes()))
    except (pki.CertificateError, OSError) as exc:
        return CertFact(label, None, str(exc))
    return CertFact(label, info.not_after)


def _file_certificates(home: ManagerHome) -> list[CertFact]:
    fleet_pki = home.pki()
    facts = [_cert_file(home, "CA", fleet_pki.ca_path)]
    servers = fleet_pki.root / "servers"
    names = set(SERVERS) | {p.stem for p in servers.glob("*.crt")}
    facts += [_cert_file(home, f"server {name}", servers / f"{name}.crt") for name in sorted(names)]
    facts.append(_cert_file(home, "manager client", fleet_pki.manager_files().cert))
    return facts


def _store_facts(home: ManagerHome, now: dt.datetime) -> tuple[list[CertFact], list[RevokedFact]]:
    if not home.db_path.exists():  # never create a store to look at it
        return [], []
    store = Store(home.db_path)
    try:
        issued = credentials.certificates(store)
    finally:
        store.close()
    certs, revoked = [], []
    for cert in issued:
        not_after = dt.datetime.fromtimestamp(cert.not_after, dt.UTC)
        if cert.revoked_at is not None:
            if not_after > now:  # an expired one is refused by its dates; no CRL needed
                at = dt.datetime.fromtimestamp(float(cert.revoked_at), dt.UTC)
                revoked.append(RevokedFact(cert.serial, cert.identity, at))
            continue
        holder = f"{cert.role or 'client'} {cert.identity}"
        certs.append(CertFact(f"{holder} (serial {cert.serial:x})", not_after, holder=holder))
    return certs, revoked


def secret_paths(home: ManagerHome) -> list[Path]:
    """Private keys and secrets in the home."""
    root = home.root
    found = [
        *(root / "pki").rglob("*.key"),
        *(root / "keys").rglob("*.key"),  # rotated keys may sit in a folder of their own
        *(p for p in (root / "secrets").glob("*") if p.is_file()),
        *(p for p in [root / "broker" / "passwd"] if p.is_file()),
    ]
    return sorted(set(found))


def _mode(home: ManagerHome, path: Path) -> FileMode:
    return FileMode(_rel(home, path), stat.S_IMODE(path.stat().st_mode))


def _holding_directories(home: ManagerHome, files: list[Path]) -> list[Path]:
    """Every directory from a secret's folder up to the home: whoever can write any of
    them can replace what is below."""
    directories: set[Path] = set()
    for file in files:
        for parent in file.parents:
            directories.add(parent)
            if parent == home.root:
                break
    return sorted(directories)


def ca_key_encrypted(path: Path) -> bool | None:
    """Whether the CA key's PEM is encrypted (PKCS#8 "ENCRYPTED PRIVATE KEY", or an old
    OpenSSL "Proc-Type: 4,ENCRYPTED" header); only the header is read."""
    if not path.is_file():
        return None
    with path.open("rb") as handle:
        head = handle.read(128)
    return b"ENCRYPTED" in head


def crl_fact(home: ManagerHome) -> CrlFact:
    fleet_pki = home.pki()
    path = _rel(home, fleet_pki.crl_path)
    try:
        crl = x509.load_pem_x509_crl(fleet_pki.crl_path.read_bytes())
    except OSError as exc:
        return CrlFact(path, f"cannot be read ({exc.strerror or exc})")
    except ValueError:
        return CrlFact(path, "does not parse as a PEM CRL")
    try:
        ca = pki.load_certificate(fleet_pki.ca_path.read_bytes())
        signed = crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    except (pki.CertificateError, OSError, TypeError):
        signed = False
    if not signed:
        return CrlFact(path, "is not signed by this fleet's CA")
    return CrlFact(
        path,
        listed=frozenset(entry.serial_number for entry in crl),
        next_update=crl.next_update_utc,
    )


def log_files(home: ManagerHome) -> list[Path]:
    root = home.root
    candidates = [
        *(root / "logs").glob("*"),
        root / "broker" / "mosquitto.log",
        root / "broker" / "mosquitto.stderr",
        root / "superlink" / "superlink.log",
    ]
    return sorted(p for p in candidates if p.is_file())


def _chunks(path: Path) -> Iterator[bytes]:
    """The file in 1 MiB pieces that overlap by the mark's length (a mark cut in two
    is still found)."""
    tail = b""
    with path.open("rb") as handle:
        while chunk := handle.read(LOG_CHUNK):
            yield tail + chunk
            tail = chunk[-len(PEM_KEY_MARK) :]


def holds_private_key(path: Path) -> bool:
    return any(PEM_KEY_MARK in chunk for chunk in _chunks(path))


def _superlink_ran_plain(home: ManagerHome) -> bool:
    config = home.root / "superlink" / "flwr-cli" / "config.toml"
    if not config.is_file():
        return False
    return any(
        line.split() == ["insecure", "=", "true"] for line in config.read_text().splitlines()
    )


def signing_key_fact(home: ManagerHome) -> SigningKeyFact:
    view = trust_view(home)
    refused = [e for e in view.edges if e.status == "rejected"]
    names = {e.edge for e in refused}
    return SigningKeyFact(
        view.key_id,
        view.sequence,
        cut_short=(home.key_path.parent / "next").exists(),
        refused=tuple((e.edge, e.reason, e.key_id == view.key_id) for e in refused),
        behind=tuple(edge for edge in view.behind() if edge not in names),
    )


def _log_tail(path: Path, size: int = LOG_CHUNK) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - size))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def storage_fact(home: ManagerHome) -> StorageFact:
    """The store's room, serve's account of it, and the broker's last failed save."""
    settings = home.settings()
    serving = launcher.serve_state(home.root)
    broker_log = home.root / "broker" / "mosquitto.log"
    return StorageFact(
        store_path=str(home.db_path),
        space=space.measure(home.db_path),
        headroom=space.Headroom(settings.low_space_percent, settings.low_space_mib),
        serve_store=None if serving is None else serving.store,
        serve_detail="" if serving is None else serving.store_detail,
        held=0 if serving is None else serving.held,
        broker_save_dir=str(home.broker_persistence_dir),
        broker_save_failure=last_save_failure(_log_tail(broker_log)),
    )


def gather(home: ManagerHome, now: dt.datetime | None = None) -> HomeFacts:
    """The facts of ``home`` (raises ManagerError if it is not a manager home)."""
    settings = home.settings()
    now = now or pki.utcnow()
    has_pki = not settings.insecure or home.pki().ca_path.exists()
    certificates = _file_certificates(home) if has_pki else []
    issued, revoked = _store_facts(home, now)
    secrets = secret_paths(home)
    conf = home.root / "broker" / "mosquitto.conf"
    return HomeFacts(
        insecure=settings.insecure,
        now=now,
        certificates=tuple(certificates + issued),
        secret_files=tuple(_mode(home, p) for p in secrets),
        secret_dirs=tuple(_mode(home, p) for p in _holding_directories(home, secrets)),
        ca_key_encrypted=ca_key_encrypted(home.pki().ca_key_path),
        crl=crl_fact(home) if has_pki else None,
        revoked=tuple(revoked),
        broker_conf=conf.read_text() if conf.is_file() else None,
        superlink_ran_plain=_superlink_ran_plain(home),
        logs_with_keys=tuple(_rel(home, p) for p in log_files(home) if holds_private_key(p)),
        signing_key=signing_key_fact(home),
        storage=storage_fact(home),
    )

"""The fleet's revocation list at the station (issue 30): the station's own endpoints
(its image endpoint) refuse a revoked manager's or operator's certificate.

The manager issues the CRL (edge_manager/security/pki.py) and serves it at its enrollment
endpoint (``GET /v1/crl``). The agent fetches it at every renewal check, over TLS that
pins the fleet CA, and adopts it only when the fleet CA signed it (its issuer and
signature, checked here against the station's own CA file) and it is not older than the
one held: neither a wrong endpoint nor a replayed old list can un-revoke anyone. It is
kept beside the station's certificate (:func:`crl_path`), replaced atomically.

:class:`StationRevocations` is what an endpoint asks per connection: one ``stat`` while
the file is unchanged; a changed file is verified again before its serials are used. No
file yet (a station enrolled before the manager served its CRL) revokes nothing; a file
that is there but unusable (not the fleet CA's, unreadable) refuses every caller until a
good one arrives: a revoked manager must not get in because the list naming it is broken.
"""

import logging
import os
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path

from cryptography import x509

from fedge.protocols.pki import CertificateError, TlsFiles

log = logging.getLogger(__name__)
CRL_NAME = "fleet-crl.pem"
CRL_ROUTE = "/v1/crl"
MAX_CRL_BYTES = 4 * 2**20  # a CRL of ~100,000 serials; a larger reply is refused
TIMEOUT_S = 15.0


def crl_path(tls: TlsFiles) -> Path:
    """Where the station keeps the fleet's CRL: beside its certificate."""
    return tls.cert.with_name(CRL_NAME)


def verified(crl_pem: bytes, ca_pem: bytes) -> x509.CertificateRevocationList:
    """The CRL, if the fleet CA in ``ca_pem`` issued and signed it; else CertificateError."""
    try:
        crl = x509.load_pem_x509_crl(crl_pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError as exc:
        raise CertificateError(f"not a PEM CRL or CA certificate: {exc}") from None
    public = ca.public_key()
    if crl.issuer != ca.subject or not crl.is_signature_valid(public):  # type: ignore[arg-type]
        raise CertificateError("the CRL is not signed by this station's fleet CA")
    return crl


def fetch_crl(url: str, tls: TlsFiles, timeout_s: float = TIMEOUT_S) -> bytes:
    """The CRL the manager serves at ``url`` (its enrollment endpoint), over TLS pinned to
    the fleet CA, presenting the station's certificate. CertificateError when it fails."""
    context = ssl.create_default_context(cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    try:
        with urllib.request.urlopen(
            f"{url.rstrip('/')}{CRL_ROUTE}", context=context, timeout=timeout_s
        ) as reply:
            body = bytes(reply.read(MAX_CRL_BYTES + 1))
    except urllib.error.HTTPError as exc:
        raise CertificateError(
            f"the manager at {url} serves no CRL ({exc.code}); a manager of before issue 30 "
            "does not, upgrade it"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise CertificateError(f"fetching the fleet's CRL from {url} failed: {exc}") from None
    if len(body) > MAX_CRL_BYTES:
        raise CertificateError(f"the CRL from {url} is over {MAX_CRL_BYTES} bytes; refused")
    return body


def adopt_crl(tls: TlsFiles, crl_pem: bytes) -> bool:
    """Keep ``crl_pem`` as the station's CRL if the fleet CA signed it and it is not older
    than the one held; True if it replaced that. CertificateError if not the CA's."""
    crl = verified(crl_pem, tls.ca.read_bytes())
    path = crl_path(tls)
    try:
        held = verified(path.read_bytes(), tls.ca.read_bytes())
    except (OSError, CertificateError):
        held = None  # none yet, or a broken one: the verified new one replaces it
    if held is not None:
        if crl.last_update_utc < held.last_update_utc:
            raise CertificateError(
                f"the CRL served was issued {crl.last_update_utc:%Y-%m-%d %H:%M}, before the "
                f"one held ({held.last_update_utc:%Y-%m-%d %H:%M}); kept the newer"
            )
        if crl.last_update_utc == held.last_update_utc:
            return False
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(crl_pem)
    os.replace(partial, path)
    log.info("fleet CRL adopted: %d revoked, issued %s", len(crl), crl.last_update_utc)
    return True


def refresh_crl(url: str, tls: TlsFiles) -> bool:
    """Fetch and adopt the manager's CRL; True if it changed what the station holds."""
    return adopt_crl(tls, fetch_crl(url, tls))


class StationRevocations:
    """The serials the station's verified CRL revokes, re-read when the file changes."""

    def __init__(self, path: Path, ca: Path) -> None:
        self.path, self.ca = path, ca
        self._lock = threading.Lock()  # guards the cached pair only; never held for I/O
        self._signature: tuple[int, int, int] | None = None
        self._serials: frozenset[int] = frozenset()

    def revoked(self, serial: int) -> bool:
        """Whether ``serial`` is revoked; CertificateError when the CRL is unusable."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return False  # no CRL delivered yet
        except OSError as exc:
            raise CertificateError(f"cannot read the station's CRL {self.path}: {exc}") from None
        signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            if signature == self._signature:
                return serial in self._serials
        try:
            crl = verified(self.path.read_bytes(), self.ca.read_bytes())
        except OSError as exc:
            raise CertificateError(f"cannot read the station's CRL {self.path}: {exc}") from None
        serials = frozenset(entry.serial_number for entry in crl)
        with self._lock:
            self._signature, self._serials = signature, serials
        return serial in serials

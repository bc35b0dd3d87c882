"""Logging in with an operator certificate: the operator identities of the fleet CA
(``fedge manager operator add``), presented by the browser over ``fedge console --tls``.

The TLS layer verifies the certificate against the fleet CA and its dates (the console
asks for a client certificate, optionally, trusting the fleet CA only). This module does
not rely on that alone: whatever fills the ASGI TLS extension, the certificate must have
passed verification there, be issued by the fleet CA, be in its dates, be an
*operator's* (a station's or the manager's is not a person) and not be revoked (the
home's CRL, read through gRPC's :class:`RevocationList`: parsed again only when the file
changes; unreadable, nobody logs in by certificate). Its common name is the console
account it logs in as: the account, with its role, is made by an admin (``fedge console
token add NAME --role ...``). A session opened this way ends when the certificate is
revoked (:meth:`Revocations.revoked`).
"""

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature

from fedge.protocols import pki
from fedge.protocols.pki import CertificateError, Role
from fedge.transport.grpc.identity import RevocationList
from fedge.transport.http_server import presented_chain as presented_chain  # the console's API


@dataclass(frozen=True)
class PresentedOperator:
    name: str
    serial: int


class Revocations:
    """The fleet's CRL as the console reads it: gRPC's cached :class:`RevocationList`,
    made on first use (a home without a CRL yet is not an error until a login asks)."""

    def __init__(self, crl_path: Path) -> None:
        self.path = crl_path
        self._list: RevocationList | None = None

    def revoked(self, serial: int) -> bool:
        """Whether the CRL lists ``serial`` (an unreadable CRL counts as revoked)."""
        try:
            if self._list is None:
                self._list = RevocationList(self.path)
            return serial in self._list.serials()
        except CertificateError:
            return True


def operator_of(
    chain: list[str], ca_path: Path, crl: Revocations, now: dt.datetime | None = None
) -> PresentedOperator | None:
    """The operator a client certificate names, or None: no certificate, not the fleet
    CA's, out of its dates, not an operator's, revoked, or no readable CRL to tell."""
    if not chain:
        return None
    at = now or pki.utcnow()
    try:
        leaf = pki.load_certificate(chain[0].encode())
        leaf.verify_directly_issued_by(pki.load_certificate(ca_path.read_bytes()))
        info = pki.cert_info(leaf)
        if not info.not_before <= at <= info.not_after or info.role is not Role.OPERATOR:
            return None
        if crl.revoked(info.serial):
            return None
    except (CertificateError, OSError, ValueError, TypeError, InvalidSignature):
        return None
    return PresentedOperator(info.identity, info.serial)

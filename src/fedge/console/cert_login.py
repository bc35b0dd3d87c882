"""Logging in with an operator certificate: the operator identities of the fleet CA
(``fedge manager operator add``), presented by the browser over ``fedge console --tls``.

The TLS layer has verified the certificate against the fleet CA and its dates (the
console asks for a client certificate, optionally, and trusts the fleet CA only); here it
must also be an *operator's* (a station's or the manager's is not a person) and not
revoked (the home's CRL; unreadable: nobody logs in by certificate). Its common name is
the console account it logs in as: the account, with its role, is still made by an admin
(``fedge console token add NAME --role ...``).
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedge.protocols import pki
from fedge.protocols.pki import CertificateError, Role


def presented_chain(scope: Mapping[str, Any]) -> list[str]:
    """The client certificate chain (PEM, leaf first) the connection presented, from
    the ASGI TLS extension (empty: none, or not served over TLS)."""
    tls = scope.get("extensions", {}).get("tls") or {}
    chain = tls.get("client_cert_chain") or []
    return [str(pem) for pem in chain]


def operator_identity(chain: list[str], crl_path: Path) -> str | None:
    """The operator a verified client certificate names, or None: no certificate, not
    an operator's, revoked, or no readable CRL to tell."""
    if not chain:
        return None
    try:
        info = pki.cert_info(pki.load_certificate(chain[0].encode()))
        revoked = pki.revoked_serials(crl_path.read_bytes())
    except (CertificateError, OSError, ValueError):
        return None
    if info.role is not Role.OPERATOR or info.serial in revoked:
        return None
    return info.identity

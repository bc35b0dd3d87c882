"""Who is calling fedge's gRPC services: a station's certificate, or (development) a token.

Under mutual TLS (issue 13) BoringSSL has already checked the chain to the fleet CA and
the validity period before a handler runs; what is left is the fleet's own rules, decided
here over plain values taken from the call (its metadata and ``auth_context()``):

- the certificate must not be revoked. gRPC Python has no CRL support, so its serial is
  looked up in the fleet's CRL (:class:`RevocationList`), re-read when the file changes;
- its role (OU) must be ``edge``: an operator's or the manager's certificate is no
  station's, whatever its common name;
- its common name is the edge; a request naming another edge is refused by the server,
  and so is an ``x-fedge-edge`` metadata value naming another.

Without TLS (``--insecure``, development only) the caller names itself in metadata and
proves it with its token (:class:`TokenIdentity`), as before issue 13.

Every refusal is a :class:`Refused` carrying the gRPC status to answer with; the server
turns it into ``context.abort`` and counts it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import grpc

from fedge.protocols import pki
from fedge.protocols.errors import ProtocolError
from fedge.protocols.pki import CertificateError, CertInfo, Role

log = logging.getLogger(__name__)

TOKEN_KEY = "x-fedge-token"
EDGE_KEY = "x-fedge-edge"

# What ``context.auth_context()`` holds for a mutual-TLS peer (keys set by gRPC core).
PEM_CERT_KEY = "x509_pem_cert"
COMMON_NAME_KEY = "x509_common_name"

Metadata = Sequence[tuple[str, str | bytes]]
AuthContext = Mapping[str, object]  # at run time a dict of lists of bytes


class Refused(ProtocolError):
    """The caller may not make this call; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class EdgeAuthenticator(Protocol):
    """True if ``token`` proves the caller is ``edge``."""

    def __call__(self, edge: str, token: str) -> bool: ...


class CallerIdentity(Protocol):
    """Decides which edge a call comes from, or raises :class:`Refused`."""

    def edge(self, metadata: Metadata, auth_context: AuthContext) -> str: ...


def _metadata(metadata: Metadata) -> dict[str, str]:
    return {key: value.decode() if isinstance(value, bytes) else value for key, value in metadata}


class TokenIdentity:
    """Development (``--insecure``): the edge and its token come in the call's metadata."""

    def __init__(self, authenticate: EdgeAuthenticator) -> None:
        self.authenticate = authenticate

    def edge(self, metadata: Metadata, auth_context: AuthContext) -> str:
        meta = _metadata(metadata)
        edge, token = meta.get(EDGE_KEY, ""), meta.get(TOKEN_KEY, "")
        if not edge or not token:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "missing edge or token metadata")
        try:
            ok = self.authenticate(edge, token)
        except Exception:
            # Fail closed: a broken authenticator must not let anyone in.
            log.exception("authenticator failed for edge %r", edge)
            ok = False
        if not ok:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"invalid token for edge {edge!r}")
        return edge


@functools.lru_cache(maxsize=4096)
def _peer_info(pem: bytes) -> CertInfo:
    # Cached: a thousand stations polling present the same few thousand certificates.
    return pki.cert_info(pki.load_certificate(pem))


class RevocationList:
    """The serials in the fleet's CRL file, re-read whenever the file changes.

    One ``stat`` per call decides; the file is parsed only after it changed (the manager
    replaces it atomically on revocation, so the inode, size or mtime moves). A CRL that
    cannot be read or parsed refuses every caller until it is fixed: a revoked station
    must not get in because the list naming it is broken.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # guards the cached pair only; never held for I/O
        self._signature: tuple[int, int, int] | None = None
        self._serials: frozenset[int] = frozenset()
        self.serials()  # a bad CRL stops the server from starting, with the reason

    def serials(self) -> frozenset[int]:
        """The revoked serials now; raises :class:`CertificateError` if the CRL is bad."""
        try:
            stat = self.path.stat()
            signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            with self._lock:
                if signature == self._signature:
                    return self._serials
            serials = pki.revoked_serials(self.path.read_bytes())
        except OSError as exc:
            raise CertificateError(f"cannot read the CRL {self.path}: {exc}") from None
        except CertificateError as exc:
            raise CertificateError(f"the CRL {self.path} is not usable: {exc}") from None
        with self._lock:
            if signature != self._signature:
                log.info("revocation list %s: %d revoked", self.path, len(serials))
            self._signature, self._serials = signature, serials
        return serials


class CertificateIdentity:
    """Mutual TLS: the caller is the edge its (chain-checked) certificate names."""

    def __init__(self, crl: RevocationList | None) -> None:
        self.crl = crl

    def edge(self, metadata: Metadata, auth_context: AuthContext) -> str:
        pems = auth_context.get(PEM_CERT_KEY)
        if not isinstance(pems, list | tuple) or len(pems) != 1 or not isinstance(pems[0], bytes):
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "no client certificate: a station connects with the certificate from "
                "`fedge agent enroll`",
            )
        try:
            info = _peer_info(pems[0])
        except CertificateError as exc:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"client certificate: {exc}") from None
        self._check_revoked(info)
        if info.role is not Role.EDGE:
            role = info.role.value if info.role is not None else "no role"
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{info.identity!r} holds a certificate of role {role}; only a station's "
                "own edge certificate may call the edge services",
            )
        claimed = _metadata(metadata).get(EDGE_KEY, info.identity)
        if claimed != info.identity:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"edge {claimed!r} in metadata, but the certificate is {info.identity!r}'s",
            )
        return info.identity

    def _check_revoked(self, info: CertInfo) -> None:
        if self.crl is None:
            return
        try:
            revoked = self.crl.serials()
        except CertificateError as exc:
            log.error("refusing %r: %s", info.identity, exc)
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                "the server cannot read its revocation list; retry later",
            ) from None
        if info.serial in revoked:
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                f"certificate revoked: {info.identity!r} (serial {info.serial:x}) may not "
                "connect; enrol again with a new token",
            )

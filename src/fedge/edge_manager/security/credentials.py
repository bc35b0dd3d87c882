"""Issued certificates and enrollment tokens in the manager's store (issue 13).

The fleet CA's files are in :mod:`fedge.edge_manager.security.pki`; what it issued, to whom,
and what was revoked is here, so `fedge edge revoke` (the CLI) and the enrollment
endpoint (in `manager serve`) meet in one SQLite transaction. A token is kept only as its
SHA-256: the store leaks no credential. Redeeming a token checks and consumes it in one
``BEGIN IMMEDIATE`` transaction, so two devices presenting it at once cannot both enrol.
The statements are in :mod:`fedge.edge_manager.security.credential_store`.
"""

import datetime as dt
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Sequence

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.security import credential_store
from fedge.edge_manager.security.credential_store import IssuedCert as IssuedCert
from fedge.edge_manager.store import Store
from fedge.protocols.fleet_ca import Revoked
from fedge.protocols.pki import CertInfo

TOKEN_TTL_S = 3600.0
MAX_TOKEN_TTL_S = 7 * 24 * 3600.0


class EnrollmentError(ManagerError):
    """A token or CSR was refused; nothing was issued. ``reason`` is a short tag."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def record_certificate(
    store: Store, info: CertInfo, *, pem: bytes = b"", at: float | None = None
) -> None:
    """Record an issued certificate (``pem``: the certificate itself, public; the
    SuperLink's node keys are read from it)."""
    with store.transaction() as conn:
        credential_store.insert_certificate(conn, info, pem, time.time() if at is None else at)


def station_certificates(store: Store) -> dict[str, bytes]:
    """Every station's newest valid certificate (PEM): edge -> certificate."""
    return credential_store.station_certificates(store, time.time())


def certificates(store: Store, identity: str | None = None) -> list[IssuedCert]:
    return credential_store.certificates(store, identity)


def revoke(store: Store, identity: str, *, at: float | None = None) -> list[IssuedCert]:
    """Revoke every unrevoked certificate of ``identity``; return them (empty: none)."""
    now = time.time() if at is None else at
    with store.transaction() as conn:
        serials = credential_store.unrevoked_serials(conn, identity)
        credential_store.mark_revoked(conn, serials, now)
        # A revoked station can no longer say it went away (the broker refuses its will
        # and goodbye): its state says what happened instead of "online" forever.
        credential_store.mark_edge_revoked(conn, identity)
    return [c for c in certificates(store, identity) if str(c.serial) in serials]


def revoke_replaced(store: Store, serials: Sequence[int], *, at: float) -> None:
    """Revoke certificates a renewal replaced (credential_renewal.py): unlike
    :func:`revoke` the holder stays enrolled, with its newer certificate."""
    with store.transaction() as conn:
        credential_store.mark_revoked(conn, [str(serial) for serial in serials], at)


def revoked(store: Store, *, now: float | None = None) -> list[Revoked]:
    """Every revoked certificate still within its validity at ``now`` (an expired one is
    refused by its dates; the CRL need not grow forever)."""
    return [
        Revoked(serial, dt.datetime.fromtimestamp(at, dt.UTC))
        for serial, at in credential_store.revoked_since(store, time.time() if now is None else now)
    ]


def create_token(store: Store, edge: str, *, ttl_s: float = TOKEN_TTL_S) -> str:
    """A single-use enrollment token for ``edge``, valid ``ttl_s`` seconds. Returned once;
    only its hash is stored."""
    if not 0 < ttl_s <= MAX_TOKEN_TTL_S:
        raise ManagerError(f"a token lives between 1 s and 7 days, not {ttl_s:g} s")
    token = secrets.token_urlsafe(24)
    now = time.time()
    with store.transaction() as conn:
        credential_store.insert_token(conn, _hash(token), edge, now, now + ttl_s)
    return token


def redeem_token(
    store: Store, token: str, edge: str, issue: Callable[[], tuple[CertInfo, bytes]]
) -> CertInfo:
    """Check ``token`` was issued for ``edge``, is unused and unexpired; then ``issue``
    (sign the CSR) and consume the token and record the certificate, all in one
    transaction. A refusal raises :class:`EnrollmentError` and changes nothing."""
    digest = _hash(token)
    with store.transaction() as conn:
        stored = credential_store.token(conn, digest)
        # compare_digest: the lookup is by hash already; this keeps the check constant-time.
        if stored is None or not hmac.compare_digest(stored.token_hash, digest):
            raise EnrollmentError("unknown enrollment token", "unknown_token")
        if stored.used_at is not None:
            raise EnrollmentError("this enrollment token was already used", "token_used")
        if stored.expires_at < time.time():
            raise EnrollmentError(
                "this enrollment token has expired; issue a new one with `fedge edge enroll`",
                "token_expired",
            )
        if stored.edge != edge:
            raise EnrollmentError(
                f"this token was issued for {stored.edge!r}, not {edge!r}", "wrong_edge"
            )
        info, pem = issue()  # raises (and rolls back) if the CSR is refused
        credential_store.mark_token_used(conn, digest, time.time())
        credential_store.insert_certificate(conn, info, pem, time.time())
    return info

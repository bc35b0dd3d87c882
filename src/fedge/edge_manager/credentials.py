"""Issued certificates and enrollment tokens in the manager's store (issue 13).

The fleet CA's files are in :mod:`fedge.edge_manager.fleet_pki`; what it issued, to whom,
and what was revoked is here, so `fedge edge revoke` (the CLI) and the enrollment
endpoint (in `manager serve`) meet in one SQLite transaction. A token is kept only as its
SHA-256: the store leaks no credential. Redeeming a token checks and consumes it in one
``BEGIN IMMEDIATE`` transaction, so two devices presenting it at once cannot both enrol.
No sqlite row leaves this module.
"""

import datetime as dt
import hashlib
import hmac
import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass

from fedge.edge_manager.errors import ManagerError
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


@dataclass(frozen=True)
class IssuedCert:
    serial: int
    identity: str
    role: str
    fingerprint: str
    not_after: float
    issued_at: float
    revoked_at: float | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _insert(conn: sqlite3.Connection, info: CertInfo, pem: bytes, at: float) -> None:
    conn.execute(
        "INSERT OR IGNORE INTO certificates (serial, identity, role, fingerprint, "
        "not_after, issued_at, pem) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            str(info.serial),
            info.identity,
            info.role.value if info.role else "",
            info.fingerprint,
            info.not_after.timestamp(),
            at,
            pem.decode(),
        ),
    )


def record_certificate(
    store: Store, info: CertInfo, *, pem: bytes = b"", at: float | None = None
) -> None:
    """Record an issued certificate (``pem``: the certificate itself, public; the
    SuperLink's node keys are read from it)."""
    with store.transaction() as conn:
        _insert(conn, info, pem, time.time() if at is None else at)


def station_certificates(store: Store) -> dict[str, bytes]:
    """Every station's newest valid certificate (PEM): edge -> certificate."""
    rows = store.conn.execute(
        "SELECT identity, pem FROM certificates WHERE role = 'edge' AND revoked_at IS NULL "
        "AND not_after > ? AND pem != '' ORDER BY issued_at, serial",
        (time.time(),),
    ).fetchall()
    return {str(identity): str(pem).encode() for identity, pem in rows}


def certificates(store: Store, identity: str | None = None) -> list[IssuedCert]:
    sql = (
        "SELECT serial, identity, role, fingerprint, not_after, issued_at, revoked_at "
        "FROM certificates"
    )
    params: tuple[str, ...] = ()
    if identity is not None:
        sql, params = sql + " WHERE identity = ?", (identity,)
    rows = store.conn.execute(sql + " ORDER BY issued_at, serial", params).fetchall()
    return [
        IssuedCert(int(r[0]), str(r[1]), str(r[2]), str(r[3]), float(r[4]), float(r[5]), r[6])
        for r in rows
    ]


def revoke(store: Store, identity: str, *, at: float | None = None) -> list[IssuedCert]:
    """Revoke every unrevoked certificate of ``identity``; return them (empty: none)."""
    now = time.time() if at is None else at
    with store.transaction() as conn:
        serials = [
            str(row[0])
            for row in conn.execute(
                "SELECT serial FROM certificates WHERE identity = ? AND revoked_at IS NULL",
                (identity,),
            )
        ]
        conn.executemany(
            "UPDATE certificates SET revoked_at = ? WHERE serial = ?",
            [(now, serial) for serial in serials],
        )
        # A revoked station can no longer say it went away (the broker refuses its will
        # and goodbye): its state says what happened instead of "online" forever.
        conn.execute("UPDATE edges SET state = 'revoked' WHERE edge = ?", (identity,))
    return [c for c in certificates(store, identity) if str(c.serial) in serials]


def revoked(store: Store) -> list[Revoked]:
    """Every revoked certificate still within its validity (an expired one is refused by
    its dates; the CRL need not grow forever)."""
    rows = store.conn.execute(
        "SELECT serial, revoked_at FROM certificates WHERE revoked_at IS NOT NULL "
        "AND not_after > ?",
        (time.time(),),
    ).fetchall()
    return [Revoked(int(r[0]), dt.datetime.fromtimestamp(float(r[1]), dt.UTC)) for r in rows]


def create_token(store: Store, edge: str, *, ttl_s: float = TOKEN_TTL_S) -> str:
    """A single-use enrollment token for ``edge``, valid ``ttl_s`` seconds. Returned once;
    only its hash is stored."""
    if not 0 < ttl_s <= MAX_TOKEN_TTL_S:
        raise ManagerError(f"a token lives between 1 s and 7 days, not {ttl_s:g} s")
    token = secrets.token_urlsafe(24)
    now = time.time()
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO enrollment_tokens (token_hash, edge, created_at, expires_at) "
            "VALUES (?, ?, ?, ?)",
            (_hash(token), edge, now, now + ttl_s),
        )
    return token


def redeem_token(
    store: Store, token: str, edge: str, issue: Callable[[], tuple[CertInfo, bytes]]
) -> CertInfo:
    """Check ``token`` was issued for ``edge``, is unused and unexpired; then ``issue``
    (sign the CSR) and consume the token and record the certificate, all in one
    transaction. A refusal raises :class:`EnrollmentError` and changes nothing."""
    digest = _hash(token)
    with store.transaction() as conn:
        row = conn.execute(
            "SELECT token_hash, edge, expires_at, used_at FROM enrollment_tokens "
            "WHERE token_hash = ?",
            (digest,),
        ).fetchone()
        # compare_digest: the lookup is by hash already; this keeps the check constant-time.
        if row is None or not hmac.compare_digest(str(row[0]), digest):
            raise EnrollmentError("unknown enrollment token", "unknown_token")
        if row[3] is not None:
            raise EnrollmentError("this enrollment token was already used", "token_used")
        if float(row[2]) < time.time():
            raise EnrollmentError(
                "this enrollment token has expired; issue a new one with `fedge edge enroll`",
                "token_expired",
            )
        if str(row[1]) != edge:
            raise EnrollmentError(
                f"this token was issued for {row[1]!r}, not {edge!r}", "wrong_edge"
            )
        info, pem = issue()  # raises (and rolls back) if the CSR is refused
        conn.execute(
            "UPDATE enrollment_tokens SET used_at = ? WHERE token_hash = ?", (time.time(), digest)
        )
        _insert(conn, info, pem, time.time())
    return info

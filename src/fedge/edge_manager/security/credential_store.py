"""Issued certificates and enrollment tokens in the manager's store: their SQL.

:mod:`fedge.edge_manager.security.credentials` decides what is issued, refused and revoked, and
holds the transactions; the statements it runs are here. Functions that take a
``sqlite3.Connection`` run inside the caller's transaction. A token is stored only as
its SHA-256.
"""

import sqlite3
from dataclasses import dataclass

from fedge.edge_manager.store import Store
from fedge.protocols.pki import CertInfo


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


@dataclass(frozen=True)
class StoredToken:
    """An enrollment token as stored: its hash, the edge it was issued for, when it
    expires and when it was used (None: not yet)."""

    token_hash: str
    edge: str
    expires_at: float
    used_at: float | None


def insert_certificate(conn: sqlite3.Connection, info: CertInfo, pem: bytes, at: float) -> None:
    """Record an issued certificate (a serial recorded before is left as it was)."""
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


def station_certificates(store: Store, now: float) -> dict[str, bytes]:
    """Every station's newest certificate (PEM) unrevoked and valid at ``now``."""
    rows = store.conn.execute(
        "SELECT identity, pem FROM certificates WHERE role = 'edge' AND revoked_at IS NULL "
        "AND not_after > ? AND pem != '' ORDER BY issued_at, serial",
        (now,),
    ).fetchall()
    return {str(identity): str(pem).encode() for identity, pem in rows}


def certificates(store: Store, identity: str | None = None) -> list[IssuedCert]:
    """Every certificate issued (to ``identity`` only, if given), oldest first."""
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


def unrevoked_serials(conn: sqlite3.Connection, identity: str) -> list[str]:
    """The serials of ``identity``'s certificates not revoked yet."""
    return [
        str(row[0])
        for row in conn.execute(
            "SELECT serial FROM certificates WHERE identity = ? AND revoked_at IS NULL",
            (identity,),
        )
    ]


def mark_revoked(conn: sqlite3.Connection, serials: list[str], at: float) -> None:
    conn.executemany(
        "UPDATE certificates SET revoked_at = ? WHERE serial = ?",
        [(at, serial) for serial in serials],
    )


def mark_edge_revoked(conn: sqlite3.Connection, edge: str) -> None:
    """Set the enrolled ``edge``'s state to ``revoked`` (nothing if it is not enrolled)."""
    conn.execute("UPDATE edges SET state = 'revoked' WHERE edge = ?", (edge,))


def revoked_since(store: Store, now: float) -> list[tuple[int, float]]:
    """(serial, revoked at) of every revoked certificate still valid at ``now``."""
    rows = store.conn.execute(
        "SELECT serial, revoked_at FROM certificates WHERE revoked_at IS NOT NULL "
        "AND not_after > ?",
        (now,),
    ).fetchall()
    return [(int(r[0]), float(r[1])) for r in rows]


def insert_token(
    conn: sqlite3.Connection, token_hash: str, edge: str, created_at: float, expires_at: float
) -> None:
    conn.execute(
        "INSERT INTO enrollment_tokens (token_hash, edge, created_at, expires_at) "
        "VALUES (?, ?, ?, ?)",
        (token_hash, edge, created_at, expires_at),
    )


def token(conn: sqlite3.Connection, token_hash: str) -> StoredToken | None:
    """The token stored under ``token_hash`` (None: no such token)."""
    row = conn.execute(
        "SELECT token_hash, edge, expires_at, used_at FROM enrollment_tokens WHERE token_hash = ?",
        (token_hash,),
    ).fetchone()
    if row is None:
        return None
    return StoredToken(str(row[0]), str(row[1]), float(row[2]), row[3])


def mark_token_used(conn: sqlite3.Connection, token_hash: str, at: float) -> None:
    conn.execute("UPDATE enrollment_tokens SET used_at = ? WHERE token_hash = ?", (at, token_hash))

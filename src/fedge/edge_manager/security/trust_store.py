"""The fleet's key rotations in the manager's store: the SQL of ``fedge manager rotate-key``.

:mod:`fedge.edge_manager.security.key_rotation` makes and signs; here are the rotation links
(``trust_links``), what each station last said it trusts (``edge_trust``, written by
ingest), and the reads and writes of desired documents a rotation re-signs in place
(the manifests in the registry are re-signed through model_store.py). Functions that
take a ``sqlite3.Connection`` run inside the caller's transaction.
"""

import sqlite3
from dataclasses import dataclass

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class TrustLink:
    """One rotation: the key that signed it (id), the key it introduced (text), the
    signed link, and when."""

    sequence: int
    signer: str
    new_key: str
    envelope: str
    created_at: float


@dataclass(frozen=True)
class EdgeTrust:
    edge: str
    key_id: str  # "" until the edge has reported on a chain
    sequence: int
    status: str  # current / adopted / rejected, or "" (never reported)
    reason: str
    reported_at: float | None


@dataclass(frozen=True)
class DesiredKey:
    """Which desired document: the edge, its kind and version."""

    edge: str
    kind: str
    version: int


# -- rotation links


def last_sequence(store: Store) -> int:
    """The sequence of the newest rotation (0: never rotated)."""
    return int(store.scalar("SELECT coalesce(max(sequence), 0) FROM trust_links"))


def newest_key(store: Store) -> str | None:
    """The key (text) the newest rotation introduced (None: never rotated)."""
    value = store.scalar("SELECT new_key FROM trust_links ORDER BY sequence DESC LIMIT 1")
    return None if value is None else str(value)


def add_link(
    conn: sqlite3.Connection,
    sequence: int,
    signer: str,
    new_key: str,
    envelope: str,
    at: float,
) -> None:
    conn.execute(
        "INSERT INTO trust_links (sequence, signer, new_key, envelope, created_at) "
        "VALUES (?,?,?,?,?)",
        (sequence, signer, new_key, envelope, at),
    )


def signers(store: Store) -> set[str]:
    """The ids of the keys that signed a rotation link."""
    return {str(r["signer"]) for r in store.query("SELECT signer FROM trust_links")}


def link_envelopes(store: Store) -> list[str]:
    """The signed rotation links, in order."""
    return [
        str(r["envelope"])
        for r in store.query("SELECT envelope FROM trust_links ORDER BY sequence")
    ]


def links(store: Store) -> list[TrustLink]:
    """Every rotation, in order."""
    return [
        TrustLink(
            int(r["sequence"]),
            str(r["signer"]),
            str(r["new_key"]),
            str(r["envelope"]),
            float(r["created_at"]),
        )
        for r in store.query("SELECT * FROM trust_links ORDER BY sequence")
    ]


def edge_trust(store: Store) -> list[EdgeTrust]:
    """What every station but the revoked last said it trusts, by edge."""
    # A station is revoked when every certificate of it is.
    rows = store.query(
        "SELECT e.edge, t.key_id, t.sequence, t.status, t.reason, t.reported_at "
        "FROM edges e LEFT JOIN edge_trust t ON t.edge = e.edge WHERE e.edge NOT IN "
        "(SELECT identity FROM certificates WHERE role = 'edge' GROUP BY identity "
        "HAVING sum(revoked_at IS NULL) = 0) ORDER BY e.edge"
    )
    return [
        EdgeTrust(
            str(r["edge"]),
            str(r["key_id"] or ""),
            int(r["sequence"] or 0),
            str(r["status"] or ""),
            str(r["reason"] or ""),
            r["reported_at"],
        )
        for r in rows
    ]


# -- desired documents a rotation re-signs


def newest_documents(store: Store, except_kind: str) -> list[DesiredKey]:
    """Each edge's newest desired document of every kind but ``except_kind``."""
    rows = store.query(
        "SELECT edge, kind, version FROM desired d WHERE kind != ? AND version = "
        "(SELECT max(version) FROM desired WHERE edge=d.edge AND kind=d.kind)",
        (except_kind,),
    )
    return [DesiredKey(str(r["edge"]), str(r["kind"]), int(r["version"])) for r in rows]


def has_document(store: Store, edge: str, kind: str, version: int) -> bool:
    row = store.one(
        "SELECT 1 AS x FROM desired WHERE edge=? AND kind=? AND version=?", (edge, kind, version)
    )
    return row is not None


def document(store: Store, edge: str, kind: str, version: int) -> str | None:
    """The document (unsigned) of ``edge``'s desired ``kind`` ``version`` (None: none)."""
    row = store.one(
        "SELECT document FROM desired WHERE edge=? AND kind=? AND version=?", (edge, kind, version)
    )
    return None if row is None else str(row["document"])


def signed_document(store: Store, edge: str, kind: str, version: int) -> str | None:
    """The envelope (signed) of ``edge``'s desired ``kind`` ``version`` (None: none)."""
    row = store.one(
        "SELECT envelope FROM desired WHERE edge=? AND kind=? AND version=?", (edge, kind, version)
    )
    return None if row is None else str(row["envelope"])


def replace_signed(
    store: Store, edge: str, kind: str, version: int, document: str, envelope: str
) -> None:
    """Replace a desired document and its envelope, keeping its version, and mark it to
    be published again."""
    store.conn.execute(
        "UPDATE desired SET document=?, envelope=?, published_at=NULL "
        "WHERE edge=? AND kind=? AND version=?",
        (document, envelope, edge, kind, version),
    )


def newest_of_kinds(store: Store, kinds: tuple[str, ...]) -> list[DesiredKey]:
    """Each edge's newest desired document of each of ``kinds`` (superseded or not: the
    newest version is what an edge is sent)."""
    marks = ",".join("?" * len(kinds))
    rows = store.query(
        f"SELECT edge, kind, version FROM desired d WHERE kind IN ({marks}) AND version = "
        "(SELECT max(version) FROM desired WHERE edge=d.edge AND kind=d.kind)",
        kinds,
    )
    return [DesiredKey(str(r["edge"]), str(r["kind"]), int(r["version"])) for r in rows]

"""Desired documents in the manager's store: the SQL side of every desired document.

The serve loop and the gRPC DesiredSync read what is still to publish, the newest of
each kind for an edge, and mark one published (on its PUBACK). Operators write them
through :class:`fedge.edge_manager.fleet.operations.Fleet`, which reads the edge's newest config,
the models its deployments carry and the next version here, and writes signed
documents with :func:`write`.
"""

import sqlite3
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager.store import Store
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig

CONFIG = "config"
DEPLOY = "deploy"

# A deploy document names its deployment; the deployment row names the model.
_DEPLOYED = (
    "FROM desired x JOIN deployments d "
    "ON d.deployment_id = json_extract(x.document, '$.deployment_id') "
    "WHERE x.edge=? AND x.kind=?"
)


@dataclass(frozen=True)
class DesiredEnvelope:
    """One version of one of an edge's desired documents, as signed (JSON text)."""

    edge: str
    kind: str
    version: int
    envelope: str


def unpublished(store: Store, skip: set[tuple[str, str, int]]) -> list[DesiredEnvelope]:
    """Desired documents still to publish, minus ``skip`` (already in flight)."""
    rows = store.conn.execute(
        # One statement: a row read by a second one could be gone by then (a labels
        # document replaced by the next label deletes the older one), and its envelope
        # went out as "None", refused by the edge (issue 34: an ERROR in the demo's log).
        # A key rotation goes out before the documents its new key signed.
        "SELECT edge, kind, version, envelope FROM desired WHERE published_at IS NULL "
        "AND superseded=0 ORDER BY kind != 'trust', created_at, edge"
    ).fetchall()
    return [
        DesiredEnvelope(str(e), str(k), int(v), str(envelope))
        for e, k, v, envelope in rows
        if (e, k, int(v)) not in skip
    ]


def latest_desired(store: Store, edge: str) -> list[DesiredEnvelope]:
    """``edge``'s newest desired document of each kind (kind, version, envelope),
    published or not: what the edge gets when it asks over gRPC (issue 9), the same
    signed envelope MQTT retains or is about to."""
    rows = store.query(
        "SELECT edge, kind, version, envelope FROM desired d WHERE edge=? AND version="
        "(SELECT max(version) FROM desired WHERE edge=d.edge AND kind=d.kind) ORDER BY kind",
        (edge,),
    )
    return [_envelope_of(row) for row in rows]


def mark_published(store: Store, edge: str, kind: str, version: int, at: float) -> None:
    store.conn.execute(
        "UPDATE desired SET published_at=? WHERE edge=? AND kind=? AND version=?",
        (at, edge, kind, version),
    )


def latest_published(store: Store) -> list[DesiredEnvelope]:
    """The newest published version of every edge's documents (what a broker that lost
    its retained messages is given again)."""
    rows = store.query(
        "SELECT d.edge, d.kind, d.version, d.envelope FROM desired d "
        "JOIN (SELECT edge, kind, max(version) AS v FROM desired "
        "WHERE published_at IS NOT NULL GROUP BY edge, kind) m "
        "ON d.edge=m.edge AND d.kind=m.kind AND d.version=m.v"
    )
    return [_envelope_of(row) for row in rows]


def _envelope_of(row: dict[str, Any]) -> DesiredEnvelope:
    return DesiredEnvelope(
        str(row["edge"]), str(row["kind"]), int(row["version"]), str(row["envelope"])
    )


def latest_config(store: Store, edge: str) -> EdgeConfig | None:
    """``edge``'s newest desired config, published or not (None: it never had one)."""
    row = store.conn.execute(
        "SELECT document FROM desired WHERE edge=? AND kind=? ORDER BY version DESC LIMIT 1",
        (edge, CONFIG),
    ).fetchone()
    return None if row is None else codec.decode(str(row[0]).encode(), EdgeConfig)


def latest_document(store: Store, edge: str, kind: str) -> str | None:
    """``edge``'s newest desired document of ``kind`` as JSON text (None: none yet)."""
    row = store.conn.execute(
        "SELECT document FROM desired WHERE edge=? AND kind=? ORDER BY version DESC LIMIT 1",
        (edge, kind),
    ).fetchone()
    return None if row is None else str(row[0])


def delete_older(store: Store, edge: str, kind: str, version: int) -> None:
    """Delete ``edge``'s desired documents of ``kind`` older than ``version`` (kinds whose
    newest document says everything, so older ones are never needed)."""
    store.conn.execute(
        "DELETE FROM desired WHERE edge=? AND kind=? AND version < ?", (edge, kind, version)
    )


def latest_version(store: Store, edge: str, kind: str) -> int | None:
    """The newest version of ``edge``'s desired documents of ``kind`` (None: none yet)."""
    version = store.scalar("SELECT max(version) FROM desired WHERE edge=? AND kind=?", (edge, kind))
    return None if version is None else int(version)


def write(
    conn: sqlite3.Connection,
    edge: str,
    kind: str,
    version: int,
    document: str,
    envelope: str,
    now: float,
) -> None:
    """Store a signed desired document for the serve loop to publish. Older ones of the
    same kind not yet published are superseded: only the newest is worth sending."""
    conn.execute(
        "UPDATE desired SET superseded=1 WHERE edge=? AND kind=? AND published_at IS NULL",
        (edge, kind),
    )
    conn.execute(
        "INSERT INTO desired (edge, kind, version, document, envelope, created_at) "
        "VALUES (?,?,?,?,?,?)",
        (edge, kind, version, document, envelope, now),
    )


def deployed_model(store: Store, edge: str) -> tuple[str, int] | None:
    """(name, version) of the model in ``edge``'s newest desired deployment, if any."""
    row = store.conn.execute(
        f"SELECT d.model_name, d.model_version {_DEPLOYED} ORDER BY x.version DESC LIMIT 1",
        (edge, DEPLOY),
    ).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def deployed_models(store: Store, edge: str) -> list[tuple[str, int]]:
    """(name, version) of every model ever deployed to ``edge``, by name then version."""
    rows = store.conn.execute(
        f"SELECT DISTINCT d.model_name, d.model_version {_DEPLOYED} "
        "ORDER BY d.model_name, d.model_version",
        (edge, DEPLOY),
    ).fetchall()
    return [(str(name), int(version)) for name, version in rows]

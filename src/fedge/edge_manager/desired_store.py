"""Desired documents as the serve loop and the gRPC DesiredSync read them: what is still
to publish, the newest of each kind for an edge, and marking one published (on its
PUBACK). Operators write them through :class:`fedge.edge_manager.fleet.Fleet`.
"""

from typing import Any

from fedge.edge_manager.store import Store


def unpublished(store: Store, skip: set[tuple[str, str, int]]) -> list[dict[str, Any]]:
    """Desired documents still to publish, minus ``skip`` (already in flight)."""
    keys = store.conn.execute(
        # A key rotation goes out before the documents its new key signed.
        "SELECT edge, kind, version FROM desired WHERE published_at IS NULL "
        "AND superseded=0 ORDER BY kind != 'trust', created_at, edge"
    ).fetchall()
    todo = [(e, k, int(v)) for e, k, v in keys if (e, k, int(v)) not in skip]
    if not todo:
        return []
    return [
        {"edge": e, "kind": k, "version": v, "envelope": _envelope(store, e, k, v)}
        for e, k, v in todo
    ]


def _envelope(store: Store, edge: str, kind: str, version: int) -> str:
    return str(
        store.scalar(
            "SELECT envelope FROM desired WHERE edge=? AND kind=? AND version=?",
            (edge, kind, version),
        )
    )


def latest_desired(store: Store, edge: str) -> list[dict[str, Any]]:
    """``edge``'s newest desired document of each kind (kind, version, envelope),
    published or not: what the edge gets when it asks over gRPC (issue 9), the same
    signed envelope MQTT retains or is about to."""
    return store.query(
        "SELECT kind, version, envelope FROM desired d WHERE edge=? AND version="
        "(SELECT max(version) FROM desired WHERE edge=d.edge AND kind=d.kind) ORDER BY kind",
        (edge,),
    )


def mark_published(store: Store, edge: str, kind: str, version: int, at: float) -> None:
    store.conn.execute(
        "UPDATE desired SET published_at=? WHERE edge=? AND kind=? AND version=?",
        (at, edge, kind, version),
    )


def latest_published(store: Store) -> list[dict[str, Any]]:
    """The newest published version of every edge's documents (what a broker that lost
    its retained messages is given again)."""
    return store.query(
        "SELECT d.edge, d.kind, d.version, d.envelope FROM desired d "
        "JOIN (SELECT edge, kind, max(version) AS v FROM desired "
        "WHERE published_at IS NOT NULL GROUP BY edge, kind) m "
        "ON d.edge=m.edge AND d.kind=m.kind AND d.version=m.v"
    )

"""Enrolled edges in the manager's store: the SQL side of enrolment and the edge list.

:class:`fedge.edge_manager.fleet.operations.Fleet` enrols edges, checks their tokens and lists them
through these; only a token's SHA-256 is ever stored.
"""

import sqlite3
from dataclasses import dataclass

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class EdgeSummary:
    """One row of ``fedge edge list``: what the edge last reported, and the newest config
    version desired for it (0: none yet)."""

    edge: str
    state: str
    session: int
    last_seen: float | None
    serving: str
    config_applied: int
    config_desired: int
    deploy_stage: str
    deploy_reason: str


def enroll(store: Store, edge: str, token_sha256: str, now: float) -> None:
    """Enrol ``edge``, or give an enrolled one a new token (its state is kept)."""
    store.conn.execute(
        "INSERT INTO edges (edge, enrolled_at, token_sha256) VALUES (?,?,?) "
        "ON CONFLICT (edge) DO UPDATE SET token_sha256=excluded.token_sha256",
        (edge, now, token_sha256),
    )


def token_sha256(store: Store, edge: str) -> str | None:
    """The SHA-256 of ``edge``'s token (None: not enrolled)."""
    row = store.conn.execute("SELECT token_sha256 FROM edges WHERE edge=?", (edge,)).fetchone()
    return None if row is None else str(row[0])


def names(store: Store) -> list[str]:
    """Every enrolled edge, by name."""
    return [str(r[0]) for r in store.conn.execute("SELECT edge FROM edges ORDER BY edge")]


def summaries(store: Store) -> list[EdgeSummary]:
    """Every enrolled edge as ``fedge edge list`` shows it, by name."""
    rows = store.query(
        "SELECT e.edge, e.state, e.session, e.last_seen, e.serving, e.config_applied, "
        "coalesce((SELECT max(version) FROM desired d WHERE d.edge=e.edge AND d.kind='config'),"
        " 0) AS config_desired, e.deploy_stage, e.deploy_reason FROM edges e ORDER BY e.edge"
    )
    return [EdgeSummary(**row) for row in rows]


@dataclass(frozen=True)
class DeployProgress:
    """Where one edge's copy of a deployment is (``fedge deploy --wait`` shows it)."""

    edge: str
    stage: str
    reason: str


def deployment_progress(store: Store, deployment_id: str) -> list[DeployProgress]:
    """The edges whose current deployment is ``deployment_id``, with its stage there."""
    rows = store.conn.execute(
        "SELECT edge, deploy_stage, deploy_reason FROM edges WHERE deploy_id=? ORDER BY edge",
        (deployment_id,),
    ).fetchall()
    return [DeployProgress(str(e), str(stage), str(reason)) for e, stage, reason in rows]


def serving(conn: sqlite3.Connection, edge: str) -> str | None:
    """The model ref ``edge`` last reported serving ('': none; None: not enrolled)."""
    row = conn.execute("SELECT serving FROM edges WHERE edge=?", (edge,)).fetchone()
    return None if row is None else str(row[0])


def mark_silent_lost(store: Store, last_seen_before: float) -> list[str]:
    """Mark every ``online`` edge last heard from before ``last_seen_before`` lost, in one
    statement; returns those edges (fleet/liveness.py decides the cut-off)."""
    rows = store.conn.execute(
        "UPDATE edges SET state='lost' WHERE state='online' AND coalesce(last_seen, 0) < ? "
        "RETURNING edge",
        (last_seen_before,),
    ).fetchall()
    return sorted(str(r[0]) for r in rows)

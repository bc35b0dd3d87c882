"""Deployments in the manager's store: which model went to which edges, and when.

:meth:`fedge.edge_manager.fleet.operations.Fleet.deploy` records one here, in the transaction that
writes each edge's desired deployment document naming it (desired_store.py).
"""

import json
import sqlite3


def record(
    conn: sqlite3.Connection,
    deployment_id: str,
    name: str,
    version: int,
    edges: list[str],
    now: float,
) -> None:
    """Record the deployment of ``name:version`` to ``edges`` (in the caller's transaction)."""
    conn.execute(
        "INSERT INTO deployments (deployment_id, model_name, model_version, edges, "
        "created_at) VALUES (?,?,?,?,?)",
        (deployment_id, name, version, json.dumps(edges), now),
    )

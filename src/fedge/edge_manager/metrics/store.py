"""The store's side of the manager's metrics: aggregate reads, made when scraped.

One read-only connection (``mode=ro``: a scrape can never write the store, nor take its
write lock), shared by the scrape threads under a lock. Every query is an aggregate over
the edges table or a small table (models, rollouts, alerts, certificates, streams), so a
scrape at 1,000 stations stays a few milliseconds.
"""

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FleetReadings:
    """Everything the manager's metrics read from the store, in one consistent snapshot."""

    edges_by_state: dict[str, int]
    config_converged: int  # edges whose applied config is the newest desired one
    config_pending: int  # edges with a newer desired config than they applied
    deploy_stages: dict[str, int]
    serving: dict[str, int]  # model ref -> edges serving it
    models: list[tuple[str, int, str]]  # (name, version, run id)
    rollouts_by_state: dict[str, int]
    alerts: dict[tuple[str, bool], int]  # (kind, open) -> count
    certificates: list[tuple[str, str, float]]  # (identity, role, not_after), unrevoked
    streams: dict[str, tuple[int, int]]  # stream -> (batches stored, duplicate batches)
    last_seen: list[tuple[str, float]]  # (edge, last seen, Unix time)


class MetricsReader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = sqlite3.connect(
                f"file:{self.path}?mode=ro",
                uri=True,
                timeout=5.0,
                check_same_thread=False,
                isolation_level=None,
            )
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def read(self) -> FleetReadings:
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN")  # one snapshot for every query below
            try:
                return _read(conn)
            finally:
                conn.execute("ROLLBACK")


def _pairs(conn: sqlite3.Connection, sql: str) -> dict[str, int]:
    return {str(key): int(n) for key, n in conn.execute(sql)}


def _read(conn: sqlite3.Connection) -> FleetReadings:
    converged, pending = conn.execute(
        "SELECT coalesce(sum(e.config_applied >= d.v), 0), "
        "coalesce(sum(e.config_applied < d.v), 0) "
        "FROM edges e JOIN (SELECT edge, max(version) AS v FROM desired WHERE kind='config' "
        "GROUP BY edge) d ON d.edge = e.edge"
    ).fetchone()
    return FleetReadings(
        edges_by_state=_pairs(conn, "SELECT state, count(*) FROM edges GROUP BY state"),
        config_converged=int(converged),
        config_pending=int(pending),
        deploy_stages=_pairs(
            conn,
            "SELECT deploy_stage, count(*) FROM edges WHERE deploy_id != '' GROUP BY deploy_stage",
        ),
        serving=_pairs(
            conn, "SELECT serving, count(*) FROM edges WHERE serving != '' GROUP BY serving"
        ),
        models=[
            (str(name), int(version), str(run))
            for name, version, run in conn.execute(
                "SELECT name, version, coalesce(run_id, '') FROM models ORDER BY name, version"
            )
        ],
        rollouts_by_state=_pairs(conn, "SELECT state, count(*) FROM rollouts GROUP BY state"),
        alerts={
            (str(kind), bool(is_open)): int(n)
            for kind, is_open, n in conn.execute(
                "SELECT kind, cleared_at IS NULL, count(*) FROM alerts GROUP BY 1, 2"
            )
        },
        certificates=[
            (str(identity), str(role), float(not_after))
            for identity, role, not_after in conn.execute(
                "SELECT identity, role, max(not_after) FROM certificates "
                "WHERE revoked_at IS NULL GROUP BY identity, role"
            )
        ],
        streams={
            str(stream): (int(batches), int(duplicates))
            for stream, batches, duplicates in conn.execute(
                "SELECT stream, sum(batches), sum(duplicates) FROM streams GROUP BY stream"
            )
        },
        last_seen=[
            (str(edge), float(seen))
            for edge, seen in conn.execute(
                "SELECT edge, last_seen FROM edges WHERE last_seen IS NOT NULL ORDER BY edge"
            )
        ],
    )

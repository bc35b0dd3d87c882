"""Retention's statements: bounded deletes, dry-run counts and the running totals.

:mod:`fedge.edge_manager.retention.policy` decides what is past its limit (a cutoff per kind)
and runs each step in one transaction; the deletes here run inside it, each bounded by
``chunk`` rows, and return how many rows went. The counts are its dry run. Table names
come from retention.py's fixed lists, never from input.
"""

import sqlite3
from collections.abc import Mapping

from fedge.edge_manager.store import Store

# Desired documents nobody needs: older than the latest one published to the broker for
# that edge and kind (the edge converges on that one; `_republish_latest` sends it), or
# superseded before they were ever published. The newest row of a kind always stays:
# the next version is numbered from it.
_OBSOLETE_DESIRED = (
    "SELECT d.rowid FROM desired d JOIN (SELECT edge, kind, max(version) AS published "
    "FROM desired WHERE published_at IS NOT NULL GROUP BY edge, kind) p "
    "ON d.edge = p.edge AND d.kind = p.kind "
    "WHERE d.created_at < :cutoff AND d.version < p.published "
    "UNION SELECT rowid FROM desired WHERE created_at < :cutoff AND superseded = 1 "
    "AND published_at IS NULL"
)
# The monitor's history (issue "The closed loop"), kept as long as other history: its
# estimates by the end of their window, alerts once cleared (an open one always stays),
# and operators' acknowledgements of alerts that are gone. Gate verdicts, rollouts and
# loop runs are lineage and are never pruned.
_MONITOR_HISTORY = {
    "estimates": "SELECT rowid FROM estimates WHERE window_end < :cutoff",
    "alerts": "SELECT rowid FROM alerts WHERE cleared_at IS NOT NULL AND cleared_at < :cutoff",
    "alert_acks": (
        "SELECT rowid FROM alert_acks WHERE at < :cutoff "
        "AND alert_id NOT IN (SELECT alert_id FROM alerts)"
    ),
}
MONITOR_HISTORY_TABLES = tuple(_MONITOR_HISTORY)
# Evaluation items (issue 32, item 3): what stations scored for the gate, one row per
# (evaluation, edge, image, model), which also train the MPP predictor and the drift
# reference. Kept: every row of a model an edge serves (its MPP fit and drift reference
# read them all, so pruning never changes a fit in use), and each model's newest
# :keep evaluations; the others go. Verdicts (gate_results) and the stations' reports
# (evaluation_reports) stay: lineage, one small row each.
_OLD_EVALUATIONS = (
    "SELECT e.rowid FROM evaluations e JOIN ("
    "  SELECT model, eval_id FROM ("
    "    SELECT model, eval_id, row_number() OVER (PARTITION BY model ORDER BY max(at) DESC) AS k"
    "    FROM evaluations GROUP BY model, eval_id)"
    "  WHERE k > :keep AND model NOT IN (SELECT serving FROM edges WHERE serving != '')"
    ") o ON e.model = o.model AND e.eval_id = o.eval_id"
)


# -- one bounded step, in the caller's transaction


def delete_records(conn: sqlite3.Connection, table: str, cutoff: float, chunk: int) -> int:
    """At most ``chunk`` of ``table``'s oldest records (by their own ``at``) before ``cutoff``."""
    return conn.execute(
        f"DELETE FROM {table} WHERE rowid IN "
        f"(SELECT rowid FROM {table} WHERE at < ? ORDER BY at LIMIT ?)",
        (cutoff, chunk),
    ).rowcount


def delete_label_history(conn: sqlite3.Connection, cutoff: float, chunk: int) -> int:
    """At most ``chunk`` of the oldest replaced labels (labels.py) before ``cutoff``."""
    return conn.execute(
        "DELETE FROM label_history WHERE rowid IN "
        "(SELECT rowid FROM label_history WHERE at < ? ORDER BY at LIMIT ?)",
        (cutoff, chunk),
    ).rowcount


def delete_batch_keys(conn: sqlite3.Connection, cutoff: float, chunk: int) -> int:
    """Each stream's oldest keys, in seq order, up to the first one still young; at most
    ``chunk`` in all. ``pruned_batches`` remembers the highest seq deleted per stream."""
    budget = chunk
    streams = conn.execute("SELECT edge, stream FROM streams ORDER BY edge, stream").fetchall()
    for edge, stream in streams:
        if budget <= 0:
            break
        last: int | None = None
        deleted = 0
        # Walks the primary key from the lowest seq and stops early: bounded by the budget.
        cursor = conn.execute(
            "SELECT seq, received_at FROM batches WHERE edge=? AND stream=? ORDER BY seq",
            (edge, stream),
        )
        try:
            for seq, received_at in cursor:
                if received_at >= cutoff or deleted >= budget:
                    break
                last, deleted = int(seq), deleted + 1
        finally:
            cursor.close()  # before deleting from the table it reads
        if last is None:
            continue
        conn.execute(
            "DELETE FROM batches WHERE edge=? AND stream=? AND seq <= ?", (edge, stream, last)
        )
        conn.execute(
            "INSERT INTO pruned_batches (edge, stream, through_seq, batches) VALUES (?,?,?,?) "
            "ON CONFLICT (edge, stream) DO UPDATE SET "
            "through_seq=max(through_seq, excluded.through_seq), "
            "batches=batches+excluded.batches",
            (edge, stream, last, deleted),
        )
        budget -= deleted
    return chunk - budget


def delete_oldest(conn: sqlite3.Connection, table: str, cutoff: float, chunk: int) -> int:
    """At most ``chunk`` of ``table``'s rows written before ``cutoff``. Rows written with
    the manager's clock, so rowid order is age order: a prefix goes."""
    last: int | None = None
    seen = 0
    cursor = conn.execute(f"SELECT rowid, at FROM {table} ORDER BY rowid")
    try:
        for rowid, at in cursor:
            if at >= cutoff or seen >= chunk:
                break
            last, seen = int(rowid), seen + 1
    finally:
        cursor.close()
    if last is None:
        return 0
    return conn.execute(f"DELETE FROM {table} WHERE rowid <= ?", (last,)).rowcount


def delete_obsolete_desired(conn: sqlite3.Connection, cutoff: float, chunk: int) -> int:
    """At most ``chunk`` desired documents nobody needs, created before ``cutoff``."""
    return conn.execute(
        f"DELETE FROM desired WHERE rowid IN ({_OBSOLETE_DESIRED} LIMIT :chunk)",
        {"cutoff": cutoff, "chunk": chunk},
    ).rowcount


def delete_monitor_history(conn: sqlite3.Connection, cutoff: float, chunk: int) -> dict[str, int]:
    """At most ``chunk`` rows of each table of the monitor's history past ``cutoff``:
    rows deleted by table, in :data:`MONITOR_HISTORY_TABLES` order."""
    return {
        table: conn.execute(
            f"DELETE FROM {table} WHERE rowid IN ({doomed} LIMIT :chunk)",
            {"cutoff": cutoff, "chunk": chunk},
        ).rowcount
        for table, doomed in _MONITOR_HISTORY.items()
    }


def delete_old_evaluations(conn: sqlite3.Connection, keep: int, chunk: int) -> int:
    """At most ``chunk`` evaluation items outside what :data:`_OLD_EVALUATIONS` keeps."""
    return conn.execute(
        f"DELETE FROM evaluations WHERE rowid IN ({_OLD_EVALUATIONS} LIMIT :chunk)",
        {"keep": keep, "chunk": chunk},
    ).rowcount


def add_totals(conn: sqlite3.Connection, pruned: Mapping[str, int], now: float) -> None:
    """Add a step's deletions (kind -> rows) to the running totals."""
    conn.executemany(
        "INSERT INTO retention_totals (what, rows, last_at) VALUES (?,?,?) "
        "ON CONFLICT (what) DO UPDATE SET rows=rows+excluded.rows, last_at=excluded.last_at",
        [(what, n, now) for what, n in pruned.items() if n],
    )


# -- the dry run


def count_records(store: Store, table: str, cutoff: float) -> int:
    return int(store.scalar(f"SELECT count(*) FROM {table} WHERE at < ?", (cutoff,)))


def count_label_history(store: Store, cutoff: float) -> int:
    return int(store.scalar("SELECT count(*) FROM label_history WHERE at < ?", (cutoff,)))


def count_batch_keys(store: Store, cutoff: float) -> int:
    return int(store.scalar("SELECT count(*) FROM batches WHERE received_at < ?", (cutoff,)))


def count_obsolete_desired(store: Store, cutoff: float) -> int:
    return len(store.query(_OBSOLETE_DESIRED, {"cutoff": cutoff}))


def count_monitor_history(store: Store, cutoff: float) -> dict[str, int]:
    """Rows of each table of the monitor's history past ``cutoff``, by table."""
    return {
        table: int(
            (store.one(f"SELECT count(*) AS n FROM ({doomed})", {"cutoff": cutoff}) or {})["n"]
        )
        for table, doomed in _MONITOR_HISTORY.items()
    }


def count_old_evaluations(store: Store, keep: int) -> int:
    return int(
        (store.one(f"SELECT count(*) AS n FROM ({_OLD_EVALUATIONS})", {"keep": keep}) or {})["n"]
    )


def totals(store: Store) -> dict[str, int]:
    """Rows pruned so far, by kind."""
    return {
        str(r["what"]): int(r["rows"])
        for r in store.query("SELECT what, rows FROM retention_totals ORDER BY what")
    }

"""Retention at the manager (issue 9, defect 8): reports are kept for a while, not forever.

Limits come from manager.toml (home.ManagerSettings ``keep_*_days``). Records go by their
own time (``at``, indexed); batch keys by when they arrived; history (deploy events,
rejected messages) by when it was written; a desired document once a newer version of its
kind was published to its edge (or it was superseded before publishing).

Pruning runs in the serve loop's writer thread, one bounded step at a time: a step is one
short transaction that deletes at most ``chunk`` rows of each kind, so ingest waits for
one step at most. A step that hit its bound is followed by another soon; otherwise the
next one is ``interval_s`` away. ``fedge manager prune`` runs the same steps.

Exactly once survives pruning. A batch is stored once thanks to its (edge, stream, seq)
key in ``batches``; when retention deletes keys, ``pruned_batches`` remembers the highest
seq deleted per stream (``through_seq``). Gap tracking (gaps.py) knows every seq at or
below a stream's ``max_seq`` that is not in an open gap was received, so a redelivered
batch at or below ``through_seq`` and in no gap is a duplicate whether its key is still
there or not (:func:`fedge.edge_manager.gaps.received`), and a late batch that fills a
gap is still new. ``streams`` (the high-water marks) and ``gaps`` are never pruned.
"""

import math
import sqlite3
from collections import Counter
from dataclasses import dataclass

from fedge.edge_manager.home import ManagerSettings
from fedge.edge_manager.store import Store

DAY_S = 86400.0
# Thumbnails go with the predictions they show (thumbnail_store.py).
RECORD_TABLES = ("predictions", "telemetry", "labels", "thumbnails")
HISTORY_TABLES = ("deploy_events", "rejections")
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


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each kind of row is kept, in seconds (``math.inf``: forever)."""

    predictions_s: float
    telemetry_s: float
    labels_s: float
    batches_s: float
    history_s: float

    @classmethod
    def from_settings(cls, settings: ManagerSettings) -> "RetentionPolicy":
        return cls(
            predictions_s=settings.keep_predictions_days * DAY_S,
            telemetry_s=settings.keep_telemetry_days * DAY_S,
            labels_s=settings.keep_labels_days * DAY_S,
            batches_s=settings.keep_batches_days * DAY_S,
            history_s=settings.keep_history_days * DAY_S,
        )

    def records_s(self, table: str) -> float:
        return {
            "predictions": self.predictions_s,
            "thumbnails": self.predictions_s,
            "telemetry": self.telemetry_s,
            "labels": self.labels_s,
        }[table]


def _cutoff(now: float, keep_s: float) -> float | None:
    return None if math.isinf(keep_s) else now - keep_s


def prune_step(
    conn: sqlite3.Connection, policy: RetentionPolicy, now: float, chunk: int
) -> tuple[Counter[str], bool]:
    """One bounded pass inside the caller's transaction: (rows deleted by kind, more due)."""
    pruned: Counter[str] = Counter()
    for table in RECORD_TABLES:
        cutoff = _cutoff(now, policy.records_s(table))
        if cutoff is not None:
            pruned[table] = conn.execute(
                f"DELETE FROM {table} WHERE rowid IN "
                f"(SELECT rowid FROM {table} WHERE at < ? ORDER BY at LIMIT ?)",
                (cutoff, chunk),
            ).rowcount
    cutoff = _cutoff(now, policy.labels_s)
    if cutoff is not None:  # replaced labels (labels.py) go with the labels, by their `at`
        pruned["labels"] += conn.execute(
            "DELETE FROM label_history WHERE rowid IN "
            "(SELECT rowid FROM label_history WHERE at < ? ORDER BY at LIMIT ?)",
            (cutoff, chunk),
        ).rowcount
    cutoff = _cutoff(now, policy.batches_s)
    if cutoff is not None:
        pruned["batches"] = _prune_batch_keys(conn, cutoff, chunk)
    cutoff = _cutoff(now, policy.history_s)
    if cutoff is not None:
        for table in HISTORY_TABLES:
            pruned[table] = _prune_oldest(conn, table, cutoff, chunk)
        pruned["desired"] = conn.execute(
            f"DELETE FROM desired WHERE rowid IN ({_OBSOLETE_DESIRED} LIMIT :chunk)",
            {"cutoff": cutoff, "chunk": chunk},
        ).rowcount
        for table, doomed in _MONITOR_HISTORY.items():
            pruned[table] = conn.execute(
                f"DELETE FROM {table} WHERE rowid IN ({doomed} LIMIT :chunk)",
                {"cutoff": cutoff, "chunk": chunk},
            ).rowcount
    _add_totals(conn, pruned, now)
    return pruned, any(n >= chunk for n in pruned.values())


def _prune_batch_keys(conn: sqlite3.Connection, cutoff: float, chunk: int) -> int:
    """Each stream's oldest keys, in seq order, up to the first one still young."""
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


def _prune_oldest(conn: sqlite3.Connection, table: str, cutoff: float, chunk: int) -> int:
    """Rows written with the manager's clock, so rowid order is age order: a prefix goes."""
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


def _add_totals(conn: sqlite3.Connection, pruned: Counter[str], now: float) -> None:
    conn.executemany(
        "INSERT INTO retention_totals (what, rows, last_at) VALUES (?,?,?) "
        "ON CONFLICT (what) DO UPDATE SET rows=rows+excluded.rows, last_at=excluded.last_at",
        [(what, n, now) for what, n in pruned.items() if n],
    )


def due(store: Store, policy: RetentionPolicy, now: float) -> dict[str, int]:
    """Rows past their limit right now (a dry run; batch keys are pruned oldest first, so
    a young key ahead of old ones holds those back a little)."""
    counts: dict[str, int] = {}
    for table in RECORD_TABLES:
        cutoff = _cutoff(now, policy.records_s(table))
        counts[table] = (
            0
            if cutoff is None
            else int(store.scalar(f"SELECT count(*) FROM {table} WHERE at < ?", (cutoff,)))
        )
    cutoff = _cutoff(now, policy.labels_s)
    if cutoff is not None:
        counts["labels"] += int(
            store.scalar("SELECT count(*) FROM label_history WHERE at < ?", (cutoff,))
        )
    cutoff = _cutoff(now, policy.batches_s)
    counts["batches"] = (
        0
        if cutoff is None
        else int(store.scalar("SELECT count(*) FROM batches WHERE received_at < ?", (cutoff,)))
    )
    cutoff = _cutoff(now, policy.history_s)
    for table in HISTORY_TABLES:
        counts[table] = (
            0
            if cutoff is None
            else int(store.scalar(f"SELECT count(*) FROM {table} WHERE at < ?", (cutoff,)))
        )
    counts["desired"] = (
        0 if cutoff is None else len(store.query(_OBSOLETE_DESIRED, {"cutoff": cutoff}))
    )
    for table, doomed in _MONITOR_HISTORY.items():
        counts[table] = (
            0
            if cutoff is None
            else int(
                (store.one(f"SELECT count(*) AS n FROM ({doomed})", {"cutoff": cutoff}) or {})["n"]
            )
        )
    return counts


def totals(store: Store) -> dict[str, int]:
    """Rows pruned so far, by kind (by the serve loop and ``fedge manager prune`` alike)."""
    return {
        str(r["what"]): int(r["rows"])
        for r in store.query("SELECT what, rows FROM retention_totals ORDER BY what")
    }


class Pruner:
    """When to prune, for a loop that calls :meth:`run` whenever :meth:`due` says so."""

    def __init__(
        self,
        policy: RetentionPolicy,
        *,
        interval_s: float = 60.0,
        chunk: int = 2000,
        busy_pause_s: float = 0.25,
    ) -> None:
        self.policy = policy
        self.interval_s = interval_s
        self.chunk = chunk
        self.busy_pause_s = busy_pause_s
        self._next_at = 0.0  # the first check comes as soon as the loop runs

    def due(self, now: float) -> bool:
        return now >= self._next_at

    def run(self, store: Store, now: float) -> Counter[str]:
        more = False
        try:
            with store.transaction() as conn:
                pruned, more = prune_step(conn, self.policy, now, self.chunk)
        finally:
            # A backlog is worked off in steps a moment apart, with ingest in between; a
            # failed step waits for the next interval.
            self._next_at = now + (self.busy_pause_s if more else self.interval_s)
        return pruned

    def run_until_done(self, store: Store, now: float) -> Counter[str]:
        """Every step that is due now, back to back (``fedge manager prune``)."""
        total: Counter[str] = Counter()
        while True:
            with store.transaction() as conn:
                pruned, more = prune_step(conn, self.policy, now, self.chunk)
            total.update(pruned)
            if not more:
                return total

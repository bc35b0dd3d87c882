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
there or not (:func:`fedge.edge_manager.ingest.gaps.received`), and a late batch that fills a
gap is still new. ``streams`` (the high-water marks) and ``gaps`` are never pruned.

The gate's evaluation items are kept by count, not age (issue 32, item 3): each model's
newest ``keep_gates_per_model`` evaluations, and every item of a model an edge serves
(its MPP fit and drift reference read them all, so pruning never changes a fit in use).

What is past its limit is decided here; the statements are in retention_store.py.
"""

import math
from collections import Counter
from dataclasses import dataclass

from fedge.edge_manager.home.layout import ManagerSettings
from fedge.edge_manager.retention import store as retention_store
from fedge.edge_manager.retention.store import MONITOR_HISTORY_TABLES
from fedge.edge_manager.store import Store, Transaction

DAY_S = 86400.0
# Thumbnails go with the predictions they show (thumbnail_store.py).
RECORD_TABLES = ("predictions", "telemetry", "labels", "thumbnails")
# History, by when it was written; so are the desired documents nobody needs any more and
# the monitor's history (MONITOR_HISTORY_TABLES; which rows: retention_store.py).
HISTORY_TABLES = ("deploy_events", "rejections")


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each kind of row is kept, in seconds (``math.inf``: forever)."""

    predictions_s: float
    telemetry_s: float
    labels_s: float
    batches_s: float
    history_s: float
    gates_per_model: int = 5

    @classmethod
    def from_settings(cls, settings: ManagerSettings) -> "RetentionPolicy":
        return cls(
            predictions_s=settings.keep_predictions_days * DAY_S,
            telemetry_s=settings.keep_telemetry_days * DAY_S,
            labels_s=settings.keep_labels_days * DAY_S,
            batches_s=settings.keep_batches_days * DAY_S,
            history_s=settings.keep_history_days * DAY_S,
            gates_per_model=settings.keep_gates_per_model,
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
    conn: Transaction, policy: RetentionPolicy, now: float, chunk: int
) -> tuple[Counter[str], bool]:
    """One bounded pass inside the caller's transaction: (rows deleted by kind, more due)."""
    pruned: Counter[str] = Counter()
    for table in RECORD_TABLES:
        cutoff = _cutoff(now, policy.records_s(table))
        if cutoff is not None:
            pruned[table] = retention_store.delete_records(conn, table, cutoff, chunk)
    cutoff = _cutoff(now, policy.labels_s)
    if cutoff is not None:  # replaced labels (labels.py) go with the labels, by their `at`
        pruned["labels"] += retention_store.delete_label_history(conn, cutoff, chunk)
    cutoff = _cutoff(now, policy.batches_s)
    if cutoff is not None:
        # Each stream's oldest keys, in seq order, up to the first one still young.
        pruned["batches"] = retention_store.delete_batch_keys(conn, cutoff, chunk)
    cutoff = _cutoff(now, policy.history_s)
    if cutoff is not None:
        for table in HISTORY_TABLES:
            pruned[table] = retention_store.delete_oldest(conn, table, cutoff, chunk)
        pruned["desired"] = retention_store.delete_obsolete_desired(conn, cutoff, chunk)
        for table, n in retention_store.delete_monitor_history(conn, cutoff, chunk).items():
            pruned[table] = n
    pruned["evaluations"] = retention_store.delete_old_evaluations(
        conn, policy.gates_per_model, chunk
    )
    retention_store.add_totals(conn, pruned, now)
    return pruned, any(n >= chunk for n in pruned.values())


def due(store: Store, policy: RetentionPolicy, now: float) -> dict[str, int]:
    """Rows past their limit right now (a dry run; batch keys are pruned oldest first, so
    a young key ahead of old ones holds those back a little)."""
    counts: dict[str, int] = {}
    for table in RECORD_TABLES:
        cutoff = _cutoff(now, policy.records_s(table))
        counts[table] = 0 if cutoff is None else retention_store.count_records(store, table, cutoff)
    cutoff = _cutoff(now, policy.labels_s)
    if cutoff is not None:
        counts["labels"] += retention_store.count_label_history(store, cutoff)
    cutoff = _cutoff(now, policy.batches_s)
    counts["batches"] = 0 if cutoff is None else retention_store.count_batch_keys(store, cutoff)
    cutoff = _cutoff(now, policy.history_s)
    for table in HISTORY_TABLES:
        counts[table] = 0 if cutoff is None else retention_store.count_records(store, table, cutoff)
    counts["desired"] = (
        0 if cutoff is None else retention_store.count_obsolete_desired(store, cutoff)
    )
    if cutoff is None:
        counts.update(dict.fromkeys(MONITOR_HISTORY_TABLES, 0))
    else:
        counts.update(retention_store.count_monitor_history(store, cutoff))
    counts["evaluations"] = retention_store.count_old_evaluations(store, policy.gates_per_model)
    return counts


def totals(store: Store) -> dict[str, int]:
    """Rows pruned so far, by kind (by the serve loop and ``fedge manager prune`` alike)."""
    return retention_store.totals(store)


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

    def hurry(self, now: float, within_s: float) -> None:
        """Run no later than ``within_s`` from ``now`` (the store's space is low: retention
        frees room inside the database file before the disk is full, issue 33)."""
        self._next_at = min(self._next_at, now + within_s)

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

"""What ``fedge edge show`` reads of one edge in the manager's store.

:func:`fedge.edge_manager.fleet_views.show` puts these beside the edge's desired config:
its row as it last reported (without its token's hash, which never leaves the store),
counts of what it sent, its open gaps and the newest value of one of its metrics.
"""

from dataclasses import dataclass
from typing import Any, Literal

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class PredictionCounts:
    predictions: int
    rejects: int
    accepts: int


@dataclass(frozen=True)
class Gap:
    """Sequence numbers of a stream not received yet, ``from_seq`` to ``to_seq``."""

    stream: str
    from_seq: int
    to_seq: int


def reported(store: Store, edge: str) -> dict[str, Any] | None:
    """``edge``'s row, every column (None: not enrolled) but its token's hash."""
    row = store.one("SELECT * FROM edges WHERE edge=?", (edge,))
    if row is not None:
        row.pop("token_sha256")
    return row


def prediction_counts(store: Store, edge: str) -> PredictionCounts:
    row = store.conn.execute(
        "SELECT count(*), coalesce(sum(decision='reject'), 0), "
        "coalesce(sum(decision='accept'), 0) FROM predictions WHERE edge=?",
        (edge,),
    ).fetchone()
    return PredictionCounts(int(row[0]), int(row[1]), int(row[2]))


def count(store: Store, table: Literal["labels", "telemetry", "rejections"], edge: str) -> int:
    """How many rows of ``table`` came from ``edge``."""
    return int(store.scalar(f"SELECT count(*) FROM {table} WHERE edge=?", (edge,)))


def gaps(store: Store, edge: str) -> list[Gap]:
    """``edge``'s open gaps, by stream and start."""
    return [
        Gap(str(r["stream"]), int(r["from_seq"]), int(r["to_seq"]))
        for r in store.query(
            "SELECT stream, from_seq, to_seq FROM gaps WHERE edge=? ORDER BY stream, from_seq",
            (edge,),
        )
    ]


def latest_metric(store: Store, edge: str, name: str) -> float | None:
    """The newest value of ``edge``'s telemetry metric ``name`` (None: never reported)."""
    value = store.scalar(
        "SELECT value FROM telemetry WHERE edge=? AND name=? ORDER BY at DESC LIMIT 1",
        (edge, name),
    )
    return None if value is None else float(value)

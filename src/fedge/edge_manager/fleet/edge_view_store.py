"""What ``fedge edge show`` reads of one edge in the manager's store.

:func:`fedge.edge_manager.fleet.views.show` puts these beside the edge's desired config
(in an ``EdgeView``): its row as it last reported (without its token's hash, which never
leaves the store), counts of what it sent, its open gaps and the newest value of one of
its metrics.
"""

from dataclasses import dataclass, fields
from typing import Literal

from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class ReportedEdge:
    """An edge's row of the ``edges`` table, every column but its token's hash."""

    edge: str
    enrolled_at: float
    state: str  # an EdgeState value, 'never-seen' or 'revoked'
    session: int  # -1: never seen
    last_seen: float | None
    agent_version: str
    serving: str  # a model reference, '' when it serves none
    config_applied: int  # the config version it applied, 0: none
    config_status: str
    config_reason: str
    config_reported_at: float | None
    deploy_id: str
    deploy_stage: str
    deploy_reason: str


# In the table's order: ``fedge edge show --json`` lists them so.
REPORTED_COLUMNS = ", ".join(f.name for f in fields(ReportedEdge))


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


def reported(store: Store, edge: str) -> ReportedEdge | None:
    """``edge``'s row as it last reported (None: not enrolled)."""
    row = store.one(f"SELECT {REPORTED_COLUMNS} FROM edges WHERE edge=?", (edge,))
    if row is None:
        return None
    last_seen, reported_at = row["last_seen"], row["config_reported_at"]
    return ReportedEdge(
        edge=str(row["edge"]),
        enrolled_at=float(row["enrolled_at"]),
        state=str(row["state"]),
        session=int(row["session"]),
        last_seen=None if last_seen is None else float(last_seen),
        agent_version=str(row["agent_version"]),
        serving=str(row["serving"]),
        config_applied=int(row["config_applied"]),
        config_status=str(row["config_status"]),
        config_reason=str(row["config_reason"]),
        config_reported_at=None if reported_at is None else float(reported_at),
        deploy_id=str(row["deploy_id"]),
        deploy_stage=str(row["deploy_stage"]),
        deploy_reason=str(row["deploy_reason"]),
    )


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


def gaps(store: Store, edge: str) -> tuple[Gap, ...]:
    """``edge``'s open gaps, by stream and start."""
    return tuple(
        Gap(str(r["stream"]), int(r["from_seq"]), int(r["to_seq"]))
        for r in store.query(
            "SELECT stream, from_seq, to_seq FROM gaps WHERE edge=? ORDER BY stream, from_seq",
            (edge,),
        )
    )


def latest_metric(store: Store, edge: str, name: str) -> float | None:
    """The newest value of ``edge``'s telemetry metric ``name`` (None: never reported)."""
    value = store.scalar(
        "SELECT value FROM telemetry WHERE edge=? AND name=? ORDER BY at DESC LIMIT 1",
        (edge, name),
    )
    return None if value is None else float(value)

"""What ingesting one message comes to, and the checks every message passes first.

Shared by :mod:`fedge.edge_manager.ingest.messages` (entry points and status documents) and
:mod:`fedge.edge_manager.ingest.records` (record batches); it imports neither.
"""

from dataclasses import dataclass
from enum import StrEnum

from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.protocols.errors import ValidationError

SQLITE_INT_MAX = 2**63 - 1


class Verdict(StrEnum):
    STORED = "stored"
    DUPLICATE = "duplicate"
    IGNORED = "ignored"  # valid but stale (e.g. a will from an older session)
    REJECTED = "rejected"


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    reason: str = ""
    detail: str = ""


def storable(value: int, what: str) -> None:
    # The wire allows u64; SQLite's INTEGER is signed 64-bit. An agent needs 2^63
    # batches to get there, so a larger value is bad input, not data.
    if value > SQLITE_INT_MAX:
        raise ValidationError(f"{what} {value} is beyond what this manager stores (2^63-1)")


class EnrolledEdges:
    """Whether a message may be stored for the edge whose topic it came on."""

    def __init__(self) -> None:
        self._known: set[str] = set()

    def check(self, tx: IngestTransaction, topic_edge: str, message_edge: str) -> None:
        if message_edge != topic_edge:
            raise ValidationError(
                f"message says edge {message_edge!r} but came from {topic_edge!r}"
            )
        if topic_edge not in self._known:
            if not tx.is_enrolled(topic_edge):
                raise ValidationError(f"edge {topic_edge!r} is not enrolled")
            self._known.add(topic_edge)

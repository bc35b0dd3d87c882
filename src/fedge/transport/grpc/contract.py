"""What the manager's gRPC services and the station's client agree on, in plain values.

Neither side's module: the server (:mod:`~fedge.transport.grpc.server`) answers with
these and the client (:mod:`~fedge.transport.grpc.client`) returns them, so a station's
code never imports the server to name what it gets back (issue 26).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fedge.protocols import topics

# What DesiredSync carries: the kinds of the down/ topics, and the retained up/ topics
# (record batches go through ReportUpload instead).
DESIRED_KINDS = tuple(kind.value for kind in topics.Down)
STATUS_KINDS = tuple(kind.value for kind in topics.STATUS)


@dataclass(frozen=True)
class SinkResult:
    """What became of one uploaded payload."""

    accepted: bool
    duplicate: bool = False
    error: str | None = None


@dataclass(frozen=True)
class DesiredDocument:
    """One signed desired document, exactly as its retained down/ topic carries it."""

    kind: str  # one of DESIRED_KINDS
    version: int
    envelope: bytes


def newer_than(
    latest: Iterable[DesiredDocument], known: Mapping[str, int]
) -> list[DesiredDocument]:
    """What an edge lacks: the documents above the version it has of their kind.

    In DESIRED_KINDS order (config, deploy, labels), the order a new MQTT session
    receives them in, so a threshold is in force before a deployment starts.
    """
    missing = [doc for doc in latest if doc.version > known.get(doc.kind, 0)]
    return sorted(missing, key=lambda doc: DESIRED_KINDS.index(doc.kind))

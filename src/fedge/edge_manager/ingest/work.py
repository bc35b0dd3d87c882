"""What ``manager serve``'s writer thread is handed: messages delivered by the broker,
uploads over gRPC, and the publisher's bookkeeping, each stored in the writer's batches
(:mod:`fedge.edge_manager.serve`; held while the store refuses writes, ingest/hold.py).
"""

from concurrent.futures import Future
from dataclasses import dataclass

from fedge.edge_manager.ingest.messages import Ingestor, Outcome
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.protocols import topics
from fedge.transport.session import Message, PublishResult


@dataclass(frozen=True)
class Upload:
    edge: str
    payload: bytes
    result: "Future[Outcome]"
    # None: a record batch (ReportUpload); else the up/ topic of a status (DesiredSync).
    kind: topics.Up | None = None


@dataclass(frozen=True)
class Published:
    result: PublishResult


@dataclass(frozen=True)
class Republish:
    pass


@dataclass(frozen=True)
class Delivered:
    """An MQTT message and the connection (a count of them) that delivered it: it is
    acknowledged on that connection only (ingest/hold.py)."""

    message: Message
    connection: int


WorkItem = Delivered | Upload | Published | Republish


def ingest_upload(ingestor: Ingestor, tx: IngestTransaction, upload: Upload, now: float) -> Outcome:
    if upload.kind is None:
        return ingestor.handle_upload(tx, upload.edge, upload.payload, now)
    return ingestor.handle_status(tx, upload.edge, upload.kind, upload.payload, now)

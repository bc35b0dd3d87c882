"""The manager's side of thumbnails: kept only while a station's config shares them, one
station's never another's, bounded per station, and bad ones refused and counted."""

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PNG_2X2

from fedge.edge_manager.ingest import thumbnail_store
from fedge.edge_manager.ingest.messages import Ingestor, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.config import EdgeConfig
from fedge.protocols.records import RecordBatch, Stream
from fedge.protocols.thumbnails import ThumbnailPolicy, ThumbnailRecord

FLEET = "plant-a"
NOW = 1000.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "manager.db")
    for edge in ("st-01", "st-02"):
        store.conn.execute(
            "INSERT INTO edges (edge, enrolled_at, token_sha256) VALUES (?, 0, 'x')", (edge,)
        )
    yield store
    store.close()


def _config(store: Store, edge: str, version: int, policy: ThumbnailPolicy | None) -> None:
    """A desired config as Fleet writes it (the manager reads only its document here)."""
    document = codec.encode(EdgeConfig(FLEET, edge, version, thumbnails=policy)).decode()
    store.conn.execute(
        "INSERT INTO desired (edge, kind, version, document, envelope, created_at) "
        "VALUES (?, 'config', ?, ?, '', 0)",
        (edge, version, document),
    )


def _send(
    ingestor: Ingestor, store: Store, edge: str, seq: int, ids: list[str], png: str = PNG_2X2
) -> Verdict:
    records = tuple(ThumbnailRecord(i, NOW + n, png) for n, i in enumerate(ids))
    payload = codec.encode(RecordBatch(edge, Stream.THUMBNAILS, 1, seq, records))
    with IngestTransaction.open(store) as tx:
        topic = topics.up(FLEET, edge, topics.Up.THUMBNAILS)
        return ingestor.handle(tx, topic, payload, NOW).verdict


def test_kept_while_shared_and_dropped_once_sharing_stops(store: Store) -> None:
    ingestor = Ingestor(store, FLEET)
    _config(store, "st-01", 1, ThumbnailPolicy())
    assert _send(ingestor, store, "st-01", 0, ["p-1", "p-2"]) is Verdict.STORED
    found = thumbnail_store.get(store, "st-01", "p-1")
    assert found is not None and (found.width, found.height) == (2, 2)
    assert found.png == base64.b64decode(PNG_2X2)

    # The operator stops sharing: what the station sends from now on is not kept, and
    # its sequence still counts (no gap opens for the batches the manager dropped).
    _config(store, "st-01", 2, None)
    assert _send(ingestor, store, "st-01", 1, ["p-3"]) is Verdict.STORED
    assert thumbnail_store.count(store, "st-01") == 2
    assert ingestor.counters["thumbnails.withheld"] == 1
    assert store.scalar("SELECT count(*) FROM gaps") == 0
    # A redelivered batch is a duplicate, as on every stream.
    assert _send(ingestor, store, "st-01", 0, ["p-1", "p-2"]) is Verdict.DUPLICATE


def test_a_station_never_sees_or_overwrites_another_stations_thumbnail(store: Store) -> None:
    ingestor = Ingestor(store, FLEET)
    _config(store, "st-01", 1, ThumbnailPolicy())
    _config(store, "st-02", 1, ThumbnailPolicy())
    _send(ingestor, store, "st-01", 0, ["p-1"])
    other = base64.b64encode(base64.b64decode(PNG_2X2) + b"trailing").decode()
    _send(ingestor, store, "st-02", 0, ["p-1"], png=other)  # the same prediction id
    one, two = (thumbnail_store.get(store, e, "p-1") for e in ("st-01", "st-02"))
    assert one is not None and two is not None and one.png != two.png
    assert thumbnail_store.available(store, [("st-01", "p-1"), ("st-02", "p-9")]) == {
        ("st-01", "p-1")
    }
    # A station writes only its own topic: a batch naming another edge is refused.
    forged = RecordBatch("st-02", Stream.THUMBNAILS, 1, 5, (ThumbnailRecord("p-7", 1.0, PNG_2X2),))
    with IngestTransaction.open(store) as tx:
        topic = topics.up(FLEET, "st-01", topics.Up.THUMBNAILS)
        outcome = ingestor.handle(tx, topic, codec.encode(forged), NOW)
    assert outcome.verdict is Verdict.REJECTED
    assert thumbnail_store.get(store, "st-02", "p-7") is None


def test_each_station_keeps_its_newest(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thumbnail_store, "KEEP_PER_EDGE", 3)
    ingestor = Ingestor(store, FLEET)
    _config(store, "st-01", 1, ThumbnailPolicy())
    _send(ingestor, store, "st-01", 0, [f"p-{n}" for n in range(5)])
    kept = store.query("SELECT prediction_id FROM thumbnails ORDER BY at")
    assert [r["prediction_id"] for r in kept] == ["p-2", "p-3", "p-4"]


@pytest.mark.parametrize(
    "png",
    [
        base64.b64encode(b"GIF89a" + b"\x00" * 40).decode(),
        "%%%not-base64%%%",
    ],
    ids=["not-png", "not-base64"],
)
def test_a_bad_thumbnail_rejects_its_batch_and_changes_nothing(store: Store, png: str) -> None:
    ingestor = Ingestor(store, FLEET)
    _config(store, "st-01", 1, ThumbnailPolicy())
    good = codec.encode(
        RecordBatch("st-01", Stream.THUMBNAILS, 1, 0, (ThumbnailRecord("p-1", 1.0, PNG_2X2),))
    )
    wire = json.loads(good)
    wire["records"][0]["png"] = png
    with IngestTransaction.open(store) as tx:
        topic = topics.up(FLEET, "st-01", topics.Up.THUMBNAILS)
        outcome = ingestor.handle(tx, topic, json.dumps(wire).encode(), NOW)
    assert outcome.verdict is Verdict.REJECTED
    assert "thumbnail" in outcome.detail
    assert store.scalar("SELECT count(*) FROM thumbnails") == 0
    assert store.scalar("SELECT count(*) FROM batches") == 0
    assert store.scalar("SELECT count(*) FROM rejections WHERE edge='st-01'") == 1

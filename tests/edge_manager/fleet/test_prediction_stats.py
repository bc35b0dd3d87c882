"""Image statistics in the manager's predictions: stored by ingest, a store from before
them migrated, a batch with malformed statistics refused whole."""

import json
import sqlite3
from pathlib import Path

from fedge.edge_manager.ingest.messages import Ingestor, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.records import PredictionRecord, RecordBatch, Stream

FLEET = "plant-a"
EDGE = "st-01"
STATS = {"mean": 0.5, "std": 0.25, "p05": 0.0, "p95": 1.0, "edges": 0.125}

# The predictions table as releases before image statistics created it.
OLD_PREDICTIONS = """
CREATE TABLE predictions (
    prediction_id TEXT NOT NULL, edge TEXT NOT NULL, seq INTEGER NOT NULL, at REAL NOT NULL,
    model TEXT NOT NULL, scores TEXT NOT NULL, decision TEXT NOT NULL, threshold REAL NOT NULL,
    config_version INTEGER NOT NULL, latency_ms REAL NOT NULL, source TEXT NOT NULL);
INSERT INTO predictions VALUES ('p-old', 'st-01', 0, 1.0, 'inspect:1', '{"clean": 1.0}',
    'accept', 0.5, 0, 1.0, 'file:old.png');
"""


def _record(i: int, stats: dict[str, float] | None) -> PredictionRecord:
    return PredictionRecord(
        f"p-{i}",
        float(i),
        "inspect:1",
        {"clean": 0.75, "scratch": 0.25},
        "accept",
        0.5,
        1,
        1.0,
        f"file:{i}.png",
        stats,
    )


def _store(path: Path) -> Store:
    store = Store(path)
    store.conn.execute(
        "INSERT INTO edges (edge, enrolled_at, token_sha256) VALUES (?, 0, 'x')", (EDGE,)
    )
    return store


def test_a_store_from_before_image_statistics_opens_and_migrates(tmp_path: Path) -> None:
    path = tmp_path / "manager.db"
    with sqlite3.connect(path) as old:
        old.executescript(OLD_PREDICTIONS)
    store = _store(path)
    try:
        assert store.one("SELECT prediction_id, stats FROM predictions") == {
            "prediction_id": "p-old",
            "stats": "",
        }
        outcome = _ingest(Ingestor(store, FLEET), store, (_record(1, STATS),))
        assert outcome is Verdict.STORED
        assert json.loads(store.scalar("SELECT stats FROM predictions WHERE prediction_id='p-1'"))
    finally:
        store.close()
    Store(path).close()  # opening it again changes nothing


def _ingest(
    ingestor: Ingestor,
    store: Store,
    records: tuple[PredictionRecord, ...],
    payload: bytes | None = None,
) -> Verdict:
    batch = RecordBatch(EDGE, Stream.PREDICTIONS, 1, 0, records)
    with IngestTransaction.open(store) as tx:
        return ingestor.handle(
            tx,
            topics.up(FLEET, EDGE, topics.Up.PREDICTIONS),
            payload or codec.encode(batch),
            10.0,
        ).verdict


def test_ingest_stores_stats_and_an_empty_text_without_them(tmp_path: Path) -> None:
    store = _store(tmp_path / "manager.db")
    try:
        assert _ingest(Ingestor(store, FLEET), store, (_record(1, STATS), _record(2, None))) is (
            Verdict.STORED
        )
        rows = store.query("SELECT prediction_id, stats FROM predictions ORDER BY prediction_id")
        assert [
            (r["prediction_id"], json.loads(r["stats"]) if r["stats"] else None) for r in rows
        ] == [("p-1", STATS), ("p-2", None)]
    finally:
        store.close()


def test_a_batch_with_malformed_stats_is_rejected_counted_and_nothing_stored(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path / "manager.db")
    ingestor = Ingestor(store, FLEET)
    good = codec.encode(
        RecordBatch(EDGE, Stream.PREDICTIONS, 1, 0, (_record(1, STATS), _record(2, {"mean": 0.5})))
    )
    try:
        for bad in (
            b'{"mean":"bright"}',
            b'{"me an":0.5}',
            b"[0.5]",
            json.dumps({f"k{i}": 0.0 for i in range(40)}).encode(),
        ):
            payload = good.replace(b'{"mean":0.5}', bad)
            assert payload != good
            assert _ingest(ingestor, store, (), payload) is Verdict.REJECTED
        assert store.scalar("SELECT count(*) FROM predictions") == 0
        assert store.scalar("SELECT count(*) FROM batches") == 0
        assert [r["reason"] for r in store.query("SELECT reason FROM rejections")] == [
            "malformed",
            "invalid",
            "malformed",
            "invalid",
        ]
        assert ingestor.counters["rejected.malformed"] == 2
        assert ingestor.counters["rejected.invalid"] == 2
    finally:
        store.close()

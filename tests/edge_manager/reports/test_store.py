"""The reports' reads of the manager's store (what the benchmarks and the demo count), on a
real SQLite store written through the ingest path; no process, no socket."""

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.reports import store as reports
from fedge.edge_manager.store import Store
from fedge.protocols.records import PredictionRecord


def prediction(
    pid: str, decision: str, model: str = "inspect:1", source: str = ""
) -> PredictionRecord:
    return PredictionRecord(pid, 1.0, model, {"scratch": 0.9}, decision, 0.5, 1, 2.0, source)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    db = Store(tmp_path / "manager.db")
    with IngestTransaction.open(db) as tx:
        tx.add_predictions("st-01", 1, [prediction("p-1", "reject", source="file:a.png")])
        tx.add_predictions("st-01", 2, [prediction("p-1", "reject"), prediction("p-2", "accept")])
        tx.add_predictions("st-02", 1, [prediction("p-3", "accept", model="inspect:2")])
    yield db
    db.close()


def test_predictions_are_counted_by_edge_decision_and_model(store: Store) -> None:
    assert reports.prediction_count(store) == 4
    assert reports.prediction_count(store, edge="st-01", decision="reject") == 2
    assert reports.prediction_count(store, model="inspect:2") == 1
    assert reports.predictions_per_edge(store) == {"st-01": 3, "st-02": 1}
    assert reports.prediction_copies(store, "st-01") == {"p-1": 2, "p-2": 1}  # p-1: a duplicate
    assert reports.prediction_ids(store, "file:a.png") == ["p-1"]


def test_a_read_only_connection_reads_the_same_and_writes_nothing(store: Store) -> None:
    with reports.read_only(store.path) as conn:
        assert reports.prediction_count(conn) == 4
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            conn.execute("DELETE FROM predictions")
    assert reports.prediction_count(store) == 4

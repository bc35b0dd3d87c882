"""The agent's prediction and label index is trimmed by age; unsent records never are."""

from pathlib import Path

from fedge.edge_agent.store import LocalStore
from fedge.protocols.records import PredictionRecord


def _prediction(pid: str, at: float) -> PredictionRecord:
    return PredictionRecord(pid, at, "m:1", {"ok": 1.0}, "accept", 0.5, 1, 0.1)


def test_prune_forgets_old_predictions_and_labels_and_keeps_what_is_unsent(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "agent.db")
    store.add_predictions([_prediction(f"p-old-{i}", 100.0) for i in range(5)])
    store.add_predictions([_prediction("p-new", 10_000.0)])
    store.add_label("l-old", "p-old-0", "scratch", "op", 100.0)
    store.add_label("l-new", "p-new", "clean", "op", 10_000.0)
    assert store.seal_batches("st-01", 0, 3) >= 2
    before = store.backlog()

    assert store.prune(5_000.0, limit=3) == 4  # 3 predictions, 1 label (at most 3 each)
    assert store.prune(5_000.0, limit=3) == 2
    assert store.prune(5_000.0) == 0
    assert not store.has_prediction("p-old-4")
    assert store.has_prediction("p-new")
    assert [label["label_id"] for label in store.labels()] == ["l-new"]
    # The records to report are untouched: the outbox still holds every batch.
    assert store.backlog() == before
    store.close()

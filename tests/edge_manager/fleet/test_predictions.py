"""Looking predictions up at the manager: the filters ``fedge predictions list`` offers."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.predictions import (
    PredictionFilter,
    get_prediction,
    list_predictions,
    wait_for_predictions,
)
from fedge.edge_manager.store import Store


def add_prediction(
    store: Store, prediction_id: str, edge: str, model: str, decision: str, at: float
) -> None:
    """A prediction row as ingest stores it (tests of reading, not of ingest)."""
    scratch = 0.9 if decision == "reject" else 0.1
    store.conn.execute(
        "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
        "threshold, config_version, latency_ms, source) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (
            prediction_id,
            edge,
            1,
            at,
            model,
            json.dumps({"clean": round(1 - scratch, 3), "scratch": scratch}),
            decision,
            0.5,
            1,
            2.5,
            f"{prediction_id}.png",
        ),
    )


def add_label(store: Store, prediction_id: str, edge: str, label: str, at: float) -> None:
    store.conn.execute(
        "INSERT INTO labels (label_id, prediction_id, edge, label, who, at, origin) "
        "VALUES (?,?,?,?,?,?,?)",
        (f"l-{prediction_id}", prediction_id, edge, label, "alice", at, "operator"),
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "manager.db")
    add_prediction(store, "p-1", "st-01", "inspect:1", "accept", 100.0)
    add_prediction(store, "p-2", "st-01", "inspect:1", "reject", 200.0)
    add_prediction(store, "p-3", "st-01", "inspect:2", "reject", 300.0)
    add_prediction(store, "p-4", "st-02", "inspect:2", "accept", 400.0)
    add_label(store, "p-2", "st-01", "scratch", 250.0)
    yield store
    store.close()


def ids(store: Store, **selected: object) -> list[str]:
    return [v.prediction_id for v in list_predictions(store, PredictionFilter(**selected))]  # type: ignore[arg-type]


def test_newest_first_and_limited(store: Store) -> None:
    assert ids(store) == ["p-4", "p-3", "p-2", "p-1"]
    assert ids(store, limit=2) == ["p-4", "p-3"]


def test_each_filter_and_their_combination(store: Store) -> None:
    assert ids(store, edge="st-01") == ["p-3", "p-2", "p-1"]
    assert ids(store, model="inspect:2") == ["p-4", "p-3"]
    assert ids(store, decision="reject") == ["p-3", "p-2"]
    assert ids(store, unlabelled=True) == ["p-4", "p-3", "p-1"]
    assert ids(store, edge="st-01", decision="reject", unlabelled=True) == ["p-3"]
    assert ids(store, edge="st-09") == []


def test_a_prediction_with_its_labels(store: Store) -> None:
    view = get_prediction(store, "p-2")
    assert (view.edge, view.model, view.decision, view.top_class) == (
        "st-01",
        "inspect:1",
        "reject",
        "scratch",
    )
    assert [(label.label, label.who, label.origin) for label in view.labels] == [
        ("scratch", "alice", "operator")
    ]
    data = view.to_dict()
    assert data["labels"][0]["label"] == "scratch"
    assert json.loads(json.dumps(data)) == data  # plain values only


def test_an_unknown_id_names_the_command_that_lists_them(store: Store) -> None:
    with pytest.raises(ManagerError, match="fedge predictions list"):
        get_prediction(store, "p-nope")


@pytest.mark.parametrize(
    ("selected", "message"),
    [
        ({"decision": "rejected"}, "decision must be one of accept, reject"),
        ({"model": "inspect"}, "model must be NAME:VERSION"),
        ({"limit": 0}, "limit must be >= 1"),
    ],
)
def test_bad_filters_are_refused(selected: dict[str, object], message: str) -> None:
    with pytest.raises(ManagerError, match=message):
        PredictionFilter(**selected)  # type: ignore[arg-type]


def test_waiting_returns_at_once_when_something_matches(store: Store) -> None:
    found = wait_for_predictions(store, PredictionFilter(edge="st-02"), timeout_s=30.0)
    assert [v.prediction_id for v in found] == ["p-4"]
    assert wait_for_predictions(store, PredictionFilter(edge="st-09"), 0.0) == []

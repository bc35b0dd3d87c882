"""The aggregator's run store: runs and their states, rounds (idempotent), profiles."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.rounds.latency import LatencyProfile
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.tiers.groups import Tiers


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RunStore]:
    store = RunStore(tmp_path / "runs.db")
    yield store
    store.close()


def record(server_round: int, **changes: Any) -> RoundRecord:
    base = RoundRecord(
        server_round=server_round,
        selected=(1000, 1001, 1002),
        on_time=(1000, 1001),
        late=(1002,),
        failed=(),
        round_time_s=2.5,
        elapsed_s=2.5 * server_round,
        quorum=2,
        quorum_met=True,
        deadline_s=3.0,
        tier=1,
        stale_folded=0,
        train_metrics={"train-loss": 0.4, "local-acc": 0.7},
        eval_metrics={"accuracy": 0.8},
        failures={},
    )
    return dataclasses.replace(base, **changes)


def run_row(store: RunStore, run_id: str) -> dict[str, Any]:
    row = store.run(run_id)
    assert row is not None, f"no run {run_id!r}"
    return row


def test_a_run_moves_through_its_states(store: RunStore) -> None:
    store.create_run("job-1", json.dumps({"strategy": "tiered"}))
    run = run_row(store, "job-1")
    assert run["state"] == RunState.QUEUED.value
    assert json.loads(run["manifest"]) == {"strategy": "tiered"}
    assert run["last_round"] == 0 and run["error"] == ""

    store.set_state("job-1", RunState.RUNNING)
    assert run_row(store, "job-1")["state"] == "running"
    store.set_state("job-1", RunState.FAILED, "x" * 5000)
    failed = run_row(store, "job-1")
    assert failed["state"] == "failed"
    assert failed["error"] == "x" * 2000  # truncated
    assert failed["updated_at"] >= failed["created_at"]
    store.set_state("job-1", RunState.COMPLETED)
    assert run_row(store, "job-1")["error"] == ""

    assert store.run("nope") is None


def test_runs_are_listed_in_creation_order(store: RunStore) -> None:
    store.create_run("b", "{}", RunState.RUNNING)
    store.create_run("a", "{}")
    listed = store.runs()
    assert [r["run_id"] for r in listed] == ["b", "a"]
    assert [r["state"] for r in listed] == ["running", "queued"]
    assert "manifest" not in listed[0]


def test_a_run_id_is_created_once(store: RunStore) -> None:
    store.create_run("job", "{}")
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        store.create_run("job", "{}")


def test_rounds_decode_their_json(store: RunStore) -> None:
    store.create_run("job", "{}", RunState.RUNNING)
    store.record_round(
        "job",
        record(
            1,
            late=(),
            failed=(1002,),
            failures={1002: "NodeUnavailable: gone"},
            quorum_met=False,
            deadline_s=None,
            tier=None,
        ),
    )
    (row,) = store.rounds("job")
    assert row["round"] == 1
    assert row["selected"] == [1000, 1001, 1002]
    assert row["on_time"] == [1000, 1001]
    assert row["late"] == []
    assert row["failed"] == [1002]
    assert row["failures"] == {"1002": "NodeUnavailable: gone"}  # JSON keys are strings
    assert row["train_metrics"] == {"train-loss": 0.4, "local-acc": 0.7}
    assert row["eval_metrics"] == {"accuracy": 0.8}
    assert row["tier"] is None and row["deadline_s"] is None
    assert row["quorum"] == 2 and row["quorum_met"] == 0
    assert row["round_time_s"] == pytest.approx(2.5)
    assert row["elapsed_s"] == pytest.approx(2.5)
    assert row["stale_folded"] == 0


def test_record_round_is_idempotent_per_run_and_round(store: RunStore) -> None:
    store.create_run("job", "{}", RunState.RUNNING)
    store.create_run("other", "{}", RunState.RUNNING)
    store.record_round("job", record(1))
    store.record_round("job", record(2))
    # A resumed run records round 1 again: the row is replaced, not duplicated.
    store.record_round("job", record(1, on_time=(1000,), late=(1001, 1002), stale_folded=3))
    store.record_round("other", record(1))

    rows = store.rounds("job")
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["on_time"] == [1000]
    assert rows[0]["late"] == [1001, 1002]
    assert rows[0]["stale_folded"] == 3
    assert len(store.rounds("other")) == 1
    # last_round only moves forward.
    assert run_row(store, "job")["last_round"] == 2
    assert store.rounds("missing") == []


def test_profiles_are_saved_with_their_tiers(store: RunStore) -> None:
    store.create_run("job", "{}", RunState.RUNNING)
    profiles = {
        1000: LatencyProfile(mean_s=1.0, count=3, last_s=1.2),
        1001: LatencyProfile(mean_s=4.0, count=3, last_s=4.5, timeouts=1),
        1002: LatencyProfile(mean_s=9.0, count=2, last_s=9.0, timeouts=2),
    }
    tiers = Tiers(members=((1000,), (1001,)), dropouts=(1002,))
    store.save_profiles("job", profiles, tiers)
    rows = store.profiles("job")
    assert [r["party"] for r in rows] == [1000, 1001, 1002]
    assert [r["tier"] for r in rows] == [0, 1, None]  # a dropout has no tier
    assert rows[1] == {
        "run_id": "job",
        "party": 1001,
        "mean_s": 4.0,
        "count": 3,
        "last_s": 4.5,
        "timeouts": 1,
        "tier": 1,
    }

    # Saving again replaces (the profiles at the end of a resumed run win).
    store.save_profiles("job", {1000: LatencyProfile(mean_s=2.0, count=4, last_s=2.0)}, None)
    rows = store.profiles("job")
    assert len(rows) == 3
    assert rows[0]["mean_s"] == 2.0 and rows[0]["count"] == 4
    assert rows[0]["tier"] is None  # no tiers (plain FedAvg)
    assert store.profiles("other") == []


def test_the_store_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    first = RunStore(path)
    first.create_run("job", "{}", RunState.RUNNING)
    first.record_round("job", record(1))
    first.close()
    again = RunStore(path)  # the schema is created only if missing
    try:
        assert [r["round"] for r in again.rounds("job")] == [1]
        assert run_row(again, "job")["last_round"] == 1
    finally:
        again.close()


def test_flower_node_ids_past_two_to_the_63_are_stored_and_read_back(store: RunStore) -> None:
    """Flower's node ids are unsigned 64-bit; SQLite's integers are signed."""
    store.create_run("job", "{}", RunState.RUNNING)
    big, small = 17011983346042029610, 2265764407315205782
    profiles = {big: LatencyProfile(1.0, 1, 1.0), small: LatencyProfile(2.0, 1, 2.0)}
    store.save_profiles("job", profiles, Tiers(members=((big,), (small,)), dropouts=()))
    assert [(r["party"], r["tier"]) for r in store.profiles("job")] == [(small, 1), (big, 0)]
    store.name_parties("job", {big: "st-01"})
    assert store.party_names("job") == {big: "st-01"}
    store.record_party_metrics("job", 1, {big: {"num-examples": 3.0}})
    assert store.party_metrics("job") == [
        {"round": 1, "party": big, "metrics": {"num-examples": 3.0}}
    ]


def test_opening_waits_out_another_opener_holding_the_file(tmp_path: Path) -> None:
    """The switch to WAL is refused at once while another connection holds a lock: the
    aggregator died preparing a job while a reader had the new file open (CI, 2026-11-26)."""
    path = tmp_path / "runs.db"
    holder = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(0.5, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        store = RunStore(path)  # would raise "database is locked" without waiting
        assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        store.close()
    finally:
        release.join()
        holder.close()

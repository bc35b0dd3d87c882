"""Manager retention (issue 9, defect 8) against a real SQLite store.

Old records and batch keys go, recent ones stay, and exactly-once survives: a redelivered
batch whose key was pruned is still a duplicate, a late batch that fills a gap is still
stored, and the gaps themselves are untouched.
"""

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PNG_2X2, FleetHome, Processes, wait_until

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.ingest.messages import Ingestor, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.retention.policy import (
    DAY_S,
    Pruner,
    RetentionPolicy,
    due,
    prune_step,
    totals,
)
from fedge.edge_manager.serve import ManagerService
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.config import EdgeConfig
from fedge.protocols.records import (
    LabelRecord,
    MetricRecord,
    PredictionRecord,
    Record,
    RecordBatch,
    Stream,
)
from fedge.protocols.thumbnails import ThumbnailPolicy, ThumbnailRecord

FLEET = "plant-a"
EDGE = "st-01"
OLD = 1 * DAY_S  # when the old batches were made and arrived
RECENT = 40 * DAY_S
NOW = 45 * DAY_S  # 30 days back is day 15: OLD is past it, RECENT is not
POLICY = RetentionPolicy.from_settings(ManagerSettings(FLEET))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "manager.db")
    store.conn.execute(
        "INSERT INTO edges (edge, enrolled_at, token_sha256) VALUES (?, 0, 'x')", (EDGE,)
    )
    yield store
    store.close()


def _records(stream: Stream, seq: int, at: float) -> tuple[Record, ...]:
    if stream is Stream.PREDICTIONS:
        return (
            PredictionRecord(
                prediction_id=f"p-{seq}",
                at=at,
                model="inspect:1",
                scores={"clean": 0.75, "scratch": 0.25},
                decision="accept",
                threshold=0.5,
                config_version=1,
                latency_ms=1.0,
                source=f"file:{seq}.png",
            ),
        )
    if stream is Stream.TELEMETRY:
        return (MetricRecord("latency_ms", 1.0, at), MetricRecord("queue", 2.0, at))
    if stream is Stream.THUMBNAILS:
        return (ThumbnailRecord(f"p-{seq}", at, PNG_2X2),)
    return (LabelRecord(f"l-{seq}", f"p-{seq}", "scratch", "op", at),)


def _deliver(
    ingestor: Ingestor, store: Store, seq: int, at: float, stream: Stream = Stream.PREDICTIONS
) -> Verdict:
    """One batch made at ``at`` and arriving then (``at`` is the manager's clock too)."""
    batch = RecordBatch(EDGE, stream, 1, seq, _records(stream, seq, at))
    with IngestTransaction.open(store) as tx:
        topic = topics.up(FLEET, EDGE, topics.Up(stream.value))
        return ingestor.handle(tx, topic, codec.encode(batch), at).verdict


def _prune(store: Store, policy: RetentionPolicy = POLICY, chunk: int = 1000) -> dict[str, int]:
    with store.transaction() as conn:
        pruned, _ = prune_step(conn, policy, NOW, chunk)
    return dict(pruned)


def _seqs(store: Store, table: str) -> list[int]:
    return [int(r["seq"]) for r in store.query(f"SELECT DISTINCT seq FROM {table} ORDER BY seq")]


def _stream(store: Store) -> dict[str, Any] | None:
    return store.one("SELECT max_seq, batches, duplicates FROM streams WHERE stream='predictions'")


def test_old_records_and_keys_go_recent_ones_stay(store: Store) -> None:
    ingestor = Ingestor(store, FLEET)
    for seq in range(6):
        assert _deliver(ingestor, store, seq, OLD) is Verdict.STORED
    for seq in range(6, 10):
        assert _deliver(ingestor, store, seq, RECENT) is Verdict.STORED

    assert due(store, POLICY, NOW)["predictions"] == 6
    pruned = _prune(store)

    assert pruned["predictions"] == 6 and pruned["batches"] == 6
    assert _seqs(store, "predictions") == [6, 7, 8, 9]
    assert _seqs(store, "batches") == [6, 7, 8, 9]
    assert store.one("SELECT through_seq, batches FROM pruned_batches") == {
        "through_seq": 5,
        "batches": 6,
    }
    assert totals(store)["predictions"] == 6
    assert _prune(store) == dict.fromkeys(pruned, 0)  # nothing else is due
    # The high-water mark is kept.
    assert _stream(store) == {"max_seq": 9, "batches": 10, "duplicates": 0}


@pytest.mark.parametrize("fresh_ingestor", [False, True], ids=["cached", "restarted"])
def test_a_pruned_batch_redelivered_is_a_duplicate_and_gaps_are_unchanged(
    store: Store, fresh_ingestor: bool
) -> None:
    ingestor = Ingestor(store, FLEET)
    for seq in (0, 1, 2, 3, 5, 6):  # seq 4 never arrives: a gap
        _deliver(ingestor, store, seq, OLD)
    _deliver(ingestor, store, 7, RECENT)
    gaps_before = store.query("SELECT * FROM gaps")
    assert [(g["from_seq"], g["to_seq"]) for g in gaps_before] == [(4, 4)]

    _prune(store)
    assert _seqs(store, "batches") == [7]
    assert store.query("SELECT * FROM gaps") == gaps_before
    if fresh_ingestor:  # a restarted `serve` knows it from the store alone
        ingestor = Ingestor(store, FLEET)

    for seq in (0, 3, 5, 6):
        assert _deliver(ingestor, store, seq, RECENT) is Verdict.DUPLICATE, seq
    assert _seqs(store, "predictions") == [7]  # nothing came back as new
    assert _stream(store) == {"max_seq": 7, "batches": 7, "duplicates": 4}
    assert store.query("SELECT * FROM gaps") == gaps_before

    # The batch that never arrived is still new when it finally does, and closes its gap.
    assert _deliver(ingestor, store, 4, RECENT) is Verdict.STORED
    assert store.query("SELECT * FROM gaps") == []
    assert _seqs(store, "predictions") == [4, 7]
    # ... and newer batches go on as before.
    assert _deliver(ingestor, store, 7, RECENT) is Verdict.DUPLICATE
    assert _deliver(ingestor, store, 8, RECENT) is Verdict.STORED


def test_labels_are_kept_by_default_and_each_stream_has_its_limit(store: Store) -> None:
    ingestor = Ingestor(store, FLEET)
    # The edge shares thumbnails (its desired config says so): they are kept, then pruned
    # with the predictions they show.
    shared = EdgeConfig(FLEET, EDGE, 1, thumbnails=ThumbnailPolicy())
    store.conn.execute(
        "INSERT INTO desired (edge, kind, version, document, envelope, created_at) "
        "VALUES (?, 'config', 1, ?, '', 0)",
        (EDGE, codec.encode(shared).decode()),
    )
    for stream in Stream:
        _deliver(ingestor, store, 0, OLD, stream)
        _deliver(ingestor, store, 1, RECENT, stream)
    assert math.isinf(POLICY.labels_s)
    assert store.scalar("SELECT count(*) FROM thumbnails") == 2

    pruned = _prune(store)

    assert (pruned["predictions"], pruned["telemetry"], pruned.get("labels", 0)) == (1, 2, 0)
    assert pruned["thumbnails"] == 1
    assert store.scalar("SELECT count(*) FROM labels") == 2
    # Every stream's old key went, labels' too: dedupe does not need them.
    assert pruned["batches"] == len(Stream)
    assert _deliver(ingestor, store, 0, RECENT, Stream.LABELS) is Verdict.DUPLICATE

    short_labels = RetentionPolicy.from_settings(ManagerSettings(FLEET, keep_labels_days=10))
    assert _prune(store, short_labels)["labels"] == 1


def test_a_step_is_bounded_and_says_when_more_is_due(store: Store) -> None:
    ingestor = Ingestor(store, FLEET)
    for seq in range(5):
        _deliver(ingestor, store, seq, OLD)
    with store.transaction() as conn:
        pruned, more = prune_step(conn, POLICY, NOW, chunk=2)
    assert (pruned["predictions"], pruned["batches"], more) == (2, 2, True)
    pruner = Pruner(POLICY, chunk=2, interval_s=60, busy_pause_s=0.25)
    assert pruner.due(NOW)
    pruner.run(store, NOW)
    assert not pruner.due(NOW) and pruner.due(NOW + 0.25)  # soon again: more was due
    assert sum(pruner.run_until_done(store, NOW).values()) > 0
    assert store.scalar("SELECT count(*) FROM predictions") == 0
    assert pruner.run(store, NOW)["predictions"] == 0
    assert not pruner.due(NOW + 59) and pruner.due(NOW + 60)  # nothing left: an interval


def test_history_and_obsolete_desired_documents_go(store: Store) -> None:
    conn = store.conn
    for version, published in ((1, True), (2, True), (3, True), (4, False), (5, False)):
        conn.execute(
            "INSERT INTO desired (edge, kind, version, document, envelope, created_at, "
            "published_at, superseded) VALUES (?, 'config', ?, '{}', '{}', ?, ?, ?)",
            (EDGE, version, OLD, OLD if published else None, int(version == 4)),
        )
    conn.execute(  # a kind never published yet keeps everything but superseded rows
        "INSERT INTO desired (edge, kind, version, document, envelope, created_at) "
        "VALUES (?, 'deploy', 1, '{}', '{}', ?)",
        (EDGE, OLD),
    )
    for at in (OLD, OLD, RECENT):
        conn.execute(
            "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
            "VALUES (?, 'd-1', 'active', '', '', ?)",
            (EDGE, at),
        )
        conn.execute(
            "INSERT INTO rejections (at, edge, topic, reason, detail) VALUES (?, ?, 't', 'r', 'd')",
            (at, EDGE),
        )
    # History is kept 90 days: prune as of day 100.
    with store.transaction() as c:
        pruned, _ = prune_step(c, POLICY, 100 * DAY_S, 1000)

    assert (pruned["deploy_events"], pruned["rejections"], pruned["desired"]) == (2, 2, 3)
    kept = store.query("SELECT kind, version FROM desired ORDER BY kind, version")
    # config: v3 is what the broker holds, v5 is pending; deploy v1 is pending.
    assert [(r["kind"], r["version"]) for r in kept] == [
        ("config", 3),
        ("config", 5),
        ("deploy", 1),
    ]


def test_the_monitors_history_goes_open_alerts_and_lineage_stay(store: Store) -> None:
    conn = store.conn
    for window_end in (OLD, RECENT):
        conn.execute(
            "INSERT INTO estimates (edge, model, window_start, window_end, n, mpp, calibration, "
            "labelled, true_accuracy) VALUES (?, 'inspect:1', ?, ?, 100, 0.9, 0.95, 0, NULL)",
            (EDGE, window_end - 60, window_end),
        )
    alerts = {"old-cleared": OLD, "recent-cleared": RECENT, "old-open": None}
    for alert_id, cleared in alerts.items():
        conn.execute(
            "INSERT INTO alerts VALUES (?, ?, 'inspect:1', 'input_drift', 0.4, 0.25, '{}', ?, ?)",
            (alert_id, EDGE, OLD, cleared),
        )
    conn.execute(
        "INSERT INTO alert_acks (alert_id, edge, model, kind, who, note, at) "
        "VALUES ('gone', ?, 'inspect:1', 'input_drift', 'alice', '', ?)",
        (EDGE, OLD),
    )
    conn.execute("INSERT INTO gate_results VALUES ('inspect', 2, 1, '{}', 'e-1', ?)", (OLD,))
    assert {
        k: v
        for k, v in due(store, POLICY, 100 * DAY_S).items()
        if k in ("estimates", "alerts", "alert_acks")
    } == {"estimates": 1, "alerts": 1, "alert_acks": 1}
    with store.transaction() as c:
        pruned, _ = prune_step(c, POLICY, 100 * DAY_S, 1000)

    assert (pruned["estimates"], pruned["alerts"], pruned["alert_acks"]) == (1, 1, 1)
    kept = {r["alert_id"] for r in store.query("SELECT alert_id FROM alerts")}
    assert kept == {"recent-cleared", "old-open"}  # an open alert stays, however old
    assert store.scalar("SELECT count(*) FROM estimates") == 1
    assert store.scalar("SELECT count(*) FROM gate_results") == 1  # lineage is kept


def test_an_old_manager_toml_gets_the_default_limits(tmp_path: Path) -> None:
    home = ManagerHome(tmp_path / "home")
    home.init(ManagerSettings(FLEET))
    text = home.settings_path.read_text()
    assert "keep_labels_days = inf" in text
    assert home.settings().keep_labels_days == math.inf  # written and read back
    old = "\n".join(line for line in text.splitlines() if not line.startswith("keep_"))
    home.settings_path.write_text(old + "\n")
    settings = home.settings()
    assert (settings.keep_predictions_days, settings.keep_telemetry_days) == (30.0, 30.0)
    assert settings.keep_labels_days == math.inf

    home.settings_path.write_text(old + "\nkeep_telemetry_days = 0\n")
    with pytest.raises(ManagerError, match=r"manager.toml: keep_telemetry_days must be .* > 0"):
        home.settings()


@pytest.mark.integration
def test_the_serve_loop_prunes_and_counts(fleet_home: FleetHome) -> None:
    """The manager's writer prunes between ingest batches (no broker needed for that)."""
    with fleet_home.fleet() as fleet:
        fleet.store.conn.executemany(
            "INSERT INTO telemetry (edge, seq, idx, name, value, at) VALUES (?, 0, ?, 'm', 1, ?)",
            [("st-01", i, 1.0 if i < 5 else 4e9) for i in range(8)],
        )
    service = ManagerService(fleet_home.home)
    service.pruner = Pruner(service.pruner.policy, chunk=2, busy_pause_s=0.01)
    service.start()
    try:
        wait_until(
            lambda: service.counters["pruned.telemetry"],
            10,
            "the serve loop to prune old telemetry",
            expect=lambda n: n == 5,
        )
        assert fleet_home.db.scalar("SELECT count(*) FROM telemetry") == 3
    finally:
        service.stop()


@pytest.mark.integration
def test_prune_command_counts_then_prunes(fleet_home: FleetHome, processes: Processes) -> None:
    processes.env["FEDGE_HOME"] = str(fleet_home.home.root)
    with fleet_home.fleet() as fleet:
        fleet.store.conn.executemany(
            "INSERT INTO telemetry (edge, seq, idx, name, value, at) VALUES (?, 0, ?, 'm', 1, ?)",
            [("st-01", i, 1.0 if i < 3 else 4e9) for i in range(4)],
        )

    dry = json.loads(processes.cli("manager", "prune", "--dry-run", "--json").stdout)
    assert dry["dry_run"] is True
    assert dry["due"]["telemetry"] == 3 and dry["limit_days"]["labels"] is None
    assert fleet_home.db.scalar("SELECT count(*) FROM telemetry") == 4

    done = json.loads(processes.cli("manager", "prune", "--json").stdout)
    assert done["pruned"]["telemetry"] == 3 and done["pruned_so_far"]["telemetry"] == 3
    table = processes.cli("manager", "prune", "--dry-run").stdout.splitlines()
    assert table[0].split() == ["kind", "keep", "past", "limit", "pruned", "so", "far"]
    assert "telemetry 30 days 0 3" in [" ".join(line.split()) for line in table]
    assert "labels forever 0 0" in [" ".join(line.split()) for line in table]


def _evaluation_rows(store: Store, model: str, gates: int, items: int) -> None:
    """``gates`` evaluations of ``model`` at st-01, ``items`` labelled items each (gate k at
    time k), as the gate stores what a station scored."""
    for gate in range(1, gates + 1):
        for item in range(items):
            store.conn.execute(
                "INSERT INTO evaluations (eval_id, edge, prediction_id, model, label, scores, "
                "stats, at) VALUES (?, ?, ?, ?, 'scratch', ?, '{}', ?)",
                (f"e-{gate}", EDGE, f"h-{item}", model, json.dumps({"scratch": 0.1 * item}), gate),
            )
            store.conn.execute(
                "INSERT OR IGNORE INTO labels (label_id, prediction_id, edge, label, who, at, "
                "origin) VALUES (?, ?, ?, 'scratch', 'op', 0, 'manager')",
                (f"l-{item}", f"h-{item}", EDGE),
            )


def test_evaluation_items_keep_the_newest_gates_and_every_item_of_a_served_model(
    store: Store,
) -> None:
    """Issue 32, item 3: the gate's items are pruned by count, never those an MPP fit in
    use reads; the verdicts stay."""
    from fedge.edge_manager.gate import store as gate_store
    from fedge.edge_manager.monitor import store as monitor_store

    store.conn.execute("UPDATE edges SET serving='inspect:3' WHERE edge=?", (EDGE,))
    _evaluation_rows(store, "inspect:1", gates=7, items=3)  # retired: 2 gates too many
    _evaluation_rows(store, "inspect:3", gates=7, items=3)  # served: its fit reads them all
    store.conn.execute("INSERT INTO gate_results VALUES ('inspect', 1, 1, '{}', 'e-1', 1)")
    fit_before = monitor_store.fit_rows(store, "inspect:3")
    assert len(fit_before) == 21

    assert due(store, POLICY, NOW)["evaluations"] == 2 * 3
    with store.transaction() as conn:
        pruned, more = prune_step(conn, POLICY, NOW, chunk=4)  # bounded: 4 of the 6
    assert pruned["evaluations"] == 4 and more
    assert _prune(store)["evaluations"] == 2
    assert _prune(store)["evaluations"] == 0  # nothing more to do

    kept = store.query("SELECT DISTINCT eval_id FROM evaluations WHERE model='inspect:1'")
    assert sorted(r["eval_id"] for r in kept) == ["e-3", "e-4", "e-5", "e-6", "e-7"]
    assert monitor_store.fit_rows(store, "inspect:3") == fit_before  # the fit's input
    assert len(gate_store.scored_items(store, "e-7", EDGE)) == 2 * 3  # the last gate reads
    assert store.scalar("SELECT count(*) FROM gate_results") == 1  # the verdict stays
    assert totals(store)["evaluations"] == 6


def test_low_space_hurries_the_next_pruning_and_never_delays_it(tmp_path: Path) -> None:
    """Issue 33: under the headroom serve prunes within seconds, not at the interval."""
    pruner = Pruner(RetentionPolicy(1.0, 1.0, 1.0, 1.0, 1.0), interval_s=60.0)
    store = Store(tmp_path / "manager.db")
    pruner.run(store, 100.0)  # nothing to prune: the next run is due at 160
    store.close()
    assert not pruner.due(159.0)
    pruner.hurry(100.0, 5.0)
    assert not pruner.due(104.9) and pruner.due(105.0)
    pruner.hurry(100.0, 30.0)  # a later deadline leaves the earlier one
    assert pruner.due(105.0)

"""The Ingestor against a real (temporary) SQLite store: exactly once, gaps, bad input."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PNG_2X2

from fedge.edge_manager.ingest.messages import Ingestor, Outcome, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport, ConfigStatus
from fedge.protocols.deployment import DeployStage, DeployStatus
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.protocols.records import (
    LabelRecord,
    MetricRecord,
    PredictionRecord,
    Record,
    RecordBatch,
    Stream,
)
from fedge.protocols.thumbnails import ThumbnailRecord

FLEET = "plant-a"
EDGE = "st-01"
NOW = 1000.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "manager.db")
    for edge in (EDGE, "st-02"):
        store.conn.execute(
            "INSERT INTO edges (edge, enrolled_at, token_sha256) VALUES (?, 0, 'x')", (edge,)
        )
    yield store
    store.close()


@pytest.fixture
def ingestor(store: Store) -> Ingestor:
    return Ingestor(store, FLEET)


def _prediction(i: int) -> PredictionRecord:
    return PredictionRecord(
        prediction_id=f"p-{i}",
        at=float(i),
        model="inspect:1",
        scores={"clean": 0.75, "scratch": 0.25},
        decision="accept",
        threshold=0.5,
        config_version=1,
        latency_ms=1.5,
        source=f"file:{i}.png",
    )


def _batch(
    seq: int, stream: Stream = Stream.PREDICTIONS, edge: str = EDGE, n: int = 2, session: int = 1
) -> RecordBatch:
    records: tuple[Record, ...]
    if stream is Stream.PREDICTIONS:
        records = tuple(_prediction(seq * 100 + i) for i in range(n))
    elif stream is Stream.TELEMETRY:
        records = tuple(MetricRecord(f"m{i}", float(i), 1.0) for i in range(n))
    elif stream is Stream.THUMBNAILS:
        records = tuple(ThumbnailRecord(f"p-{seq}-{i}", 1.0, PNG_2X2) for i in range(n))
    else:
        records = tuple(
            LabelRecord(f"l-{seq}-{i}", f"p-{seq}-{i}", "scratch", "op", 1.0) for i in range(n)
        )
    return RecordBatch(edge, stream, session, seq, records)


def _topic(kind: topics.Up, edge: str = EDGE) -> str:
    return topics.up(FLEET, edge, kind)


def _handle(ingestor: Ingestor, store: Store, topic: str, payload: bytes | Any) -> Outcome:
    data = payload if isinstance(payload, bytes) else codec.encode(payload)
    with IngestTransaction.open(store) as tx:
        return ingestor.handle(tx, topic, data, NOW)


def _send(ingestor: Ingestor, store: Store, batch: RecordBatch) -> Outcome:
    return _handle(ingestor, store, _topic(topics.Up(batch.stream.value), batch.edge), batch)


def _count(store: Store, table: str) -> int:
    return int(store.scalar(f"SELECT count(*) FROM {table}"))


def _gaps(store: Store, stream: str = "predictions") -> list[tuple[int, int]]:
    rows = store.query(
        "SELECT from_seq, to_seq FROM gaps WHERE edge=? AND stream=? ORDER BY from_seq",
        (EDGE, stream),
    )
    return [(r["from_seq"], r["to_seq"]) for r in rows]


def _rejections(store: Store) -> list[dict[str, Any]]:
    return store.query("SELECT edge, topic, reason FROM rejections ORDER BY rowid")


# ---------------------------------------------------------------- record batches


def test_a_batch_is_stored_once_and_its_duplicate_counted(ingestor: Ingestor, store: Store) -> None:
    batch = _batch(0, n=3)
    assert _send(ingestor, store, batch).verdict is Verdict.STORED
    assert _count(store, "predictions") == 3
    rows = store.query("SELECT * FROM predictions ORDER BY prediction_id")
    assert rows[0]["edge"] == EDGE
    assert rows[0]["seq"] == 0
    assert json.loads(rows[0]["scores"]) == {"clean": 0.75, "scratch": 0.25}
    assert (rows[0]["model"], rows[0]["threshold"], rows[0]["config_version"]) == (
        "inspect:1",
        0.5,
        1,
    )

    assert _send(ingestor, store, batch).verdict is Verdict.DUPLICATE
    assert _count(store, "predictions") == 3
    stream = store.one("SELECT * FROM streams WHERE edge=? AND stream='predictions'", (EDGE,))
    assert stream is not None
    assert (stream["max_seq"], stream["batches"], stream["duplicates"]) == (0, 1, 1)
    assert ingestor.counters["duplicate.batch"] == 1


def test_a_duplicate_with_other_content_is_still_a_duplicate(
    ingestor: Ingestor, store: Store
) -> None:
    _send(ingestor, store, _batch(0, n=1))
    assert _send(ingestor, store, _batch(0, n=5)).verdict is Verdict.DUPLICATE
    assert _count(store, "predictions") == 1


def test_a_fresh_ingestor_still_knows_what_was_stored(ingestor: Ingestor, store: Store) -> None:
    _send(ingestor, store, _batch(0))
    restarted = Ingestor(store, FLEET)
    assert _send(restarted, store, _batch(0)).verdict is Verdict.DUPLICATE
    assert _count(store, "predictions") == 2


def test_streams_are_numbered_independently(ingestor: Ingestor, store: Store) -> None:
    for stream in Stream:
        assert _send(ingestor, store, _batch(0, stream)).verdict is Verdict.STORED
    assert _count(store, "predictions") == 2
    assert _count(store, "telemetry") == 2
    assert _count(store, "labels") == 2
    labels = store.query("SELECT origin, edge FROM labels")
    assert labels == [{"origin": "edge", "edge": EDGE}] * 2
    # The edge's config does not share images: its thumbnails batch counts, its images
    # are not kept.
    assert _count(store, "thumbnails") == 0
    assert ingestor.counters["thumbnails.withheld"] == 2


def test_a_gap_is_recorded_and_filled_by_late_batches(ingestor: Ingestor, store: Store) -> None:
    _send(ingestor, store, _batch(0))
    _send(ingestor, store, _batch(4))
    assert _gaps(store) == [(1, 3)]
    detected = store.scalar("SELECT detected_at FROM gaps")

    _send(ingestor, store, _batch(2))
    assert _gaps(store) == [(1, 1), (3, 3)]
    _send(ingestor, store, _batch(1))
    assert _gaps(store) == [(3, 3)]
    assert store.scalar("SELECT detected_at FROM gaps") == detected

    # A restarted manager loads the open gap from the store and closes it.
    restarted = Ingestor(store, FLEET)
    assert _send(restarted, store, _batch(3)).verdict is Verdict.STORED
    assert _gaps(store) == []
    assert _count(store, "predictions") == 10
    stream = store.one("SELECT max_seq, batches FROM streams WHERE stream='predictions'")
    assert stream == {"max_seq": 4, "batches": 5}


def test_gaps_are_per_stream(ingestor: Ingestor, store: Store) -> None:
    _send(ingestor, store, _batch(0, Stream.TELEMETRY))
    _send(ingestor, store, _batch(2, Stream.TELEMETRY))
    _send(ingestor, store, _batch(0))
    assert _gaps(store, "telemetry") == [(1, 1)]
    assert _gaps(store, "predictions") == []


def test_grpc_upload_follows_the_same_rules(ingestor: Ingestor, store: Store) -> None:
    payload = codec.encode(_batch(0))
    with IngestTransaction.open(store) as tx:
        assert ingestor.handle_upload(tx, EDGE, payload, NOW).verdict is Verdict.STORED
        assert ingestor.handle_upload(tx, EDGE, payload, NOW).verdict is Verdict.DUPLICATE
        outcome = ingestor.handle_upload(tx, "st-02", payload, NOW)
    assert (outcome.verdict, outcome.reason) == (Verdict.REJECTED, "invalid")
    assert _count(store, "predictions") == 2
    assert [r["topic"] for r in _rejections(store)] == ["grpc:st-02"]


def test_a_grpc_rejection_is_counted_for_the_uploading_edge(
    ingestor: Ingestor, store: Store
) -> None:
    """`fedge edge show` counts rejections by edge id (``WHERE edge=?``)."""
    with IngestTransaction.open(store) as tx:
        ingestor.handle_upload(tx, "st-02", b"{not json", NOW)
    assert [r["edge"] for r in _rejections(store)] == ["st-02"]


# ---------------------------------------------------------------- rejections


def _assert_nothing_stored(store: Store) -> None:
    for table in ("predictions", "telemetry", "labels", "batches", "streams", "gaps"):
        assert _count(store, table) == 0, table


def test_a_batch_claiming_another_edge_is_rejected(ingestor: Ingestor, store: Store) -> None:
    outcome = _handle(ingestor, store, _topic(topics.Up.PREDICTIONS), _batch(0, edge="st-02"))
    assert outcome.verdict is Verdict.REJECTED
    assert outcome.reason == "invalid"
    assert "st-02" in outcome.detail
    assert _rejections(store) == [
        {"edge": EDGE, "topic": _topic(topics.Up.PREDICTIONS), "reason": "invalid"}
    ]
    _assert_nothing_stored(store)
    assert ingestor.counters["rejected.invalid"] == 1


def test_an_unknown_edge_is_rejected(ingestor: Ingestor, store: Store) -> None:
    topic = _topic(topics.Up.PREDICTIONS, "st-99")
    outcome = _handle(ingestor, store, topic, _batch(0, edge="st-99"))
    assert outcome.verdict is Verdict.REJECTED
    assert "not enrolled" in outcome.detail
    assert _rejections(store) == [{"edge": "st-99", "topic": topic, "reason": "invalid"}]
    _assert_nothing_stored(store)


def test_a_batch_on_the_wrong_stream_topic_is_rejected(ingestor: Ingestor, store: Store) -> None:
    outcome = _handle(ingestor, store, _topic(topics.Up.TELEMETRY), _batch(0, Stream.PREDICTIONS))
    assert (outcome.verdict, outcome.reason) == (Verdict.REJECTED, "invalid")
    _assert_nothing_stored(store)


@pytest.mark.parametrize(
    ("topic", "reason"),
    [
        ("fedge/v1/plant-b/st-01/up/predictions", "invalid"),
        ("fedge/v1/plant-a/st-01/down/config", "invalid"),
        ("fedge/v1/plant-a/st-01/up/bogus", "malformed"),
        ("fedge/v2/plant-a/st-01/up/predictions", "malformed"),
        ("fedge/v1/plant-a/st-01/up/predictions/extra", "malformed"),
    ],
)
def test_a_message_on_a_foreign_topic_is_rejected(
    ingestor: Ingestor, store: Store, topic: str, reason: str
) -> None:
    outcome = _handle(ingestor, store, topic, _batch(0))
    assert (outcome.verdict, outcome.reason) == (Verdict.REJECTED, reason)
    _assert_nothing_stored(store)
    assert len(_rejections(store)) == 1


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"{not json", "malformed"),
        (b"", "malformed"),
        (b"null", "malformed"),
        (b"\xff\xfe", "malformed"),
        (b'{"schema": 1, "kind": "record_batch"}', "malformed"),
        (b"[" * 100_000, "malformed"),
        (b" " * (256 * 1024 + 1), "oversized"),
    ],
    ids=["invalid-json", "empty", "null", "not-utf8", "missing-fields", "deep", "oversized"],
)
def test_malformed_payloads_are_rejected(
    ingestor: Ingestor, store: Store, payload: bytes, reason: str
) -> None:
    for kind in topics.Up:
        outcome = _handle(ingestor, store, _topic(kind), payload)
        assert (outcome.verdict, outcome.reason) == (Verdict.REJECTED, reason), kind
    assert len(_rejections(store)) == len(topics.Up)
    _assert_nothing_stored(store)


@pytest.mark.parametrize(
    ("u64_field", "value"),
    [("seq", 2**63), ("seq", 2**64 - 1), ("session", 2**64 - 1)],
)
def test_u64_values_beyond_sqlite_integers_are_rejected_not_raised(
    ingestor: Ingestor, store: Store, u64_field: str, value: int
) -> None:
    """The wire allows u64; SQLite's INTEGER is signed 64-bit. Bad input must not raise."""
    obj = codec.to_wire_obj(_batch(0))
    obj[u64_field] = value
    outcome = _handle(ingestor, store, _topic(topics.Up.PREDICTIONS), json.dumps(obj).encode())
    assert outcome.verdict is Verdict.REJECTED
    _assert_nothing_stored(store)


def test_liveness_session_beyond_sqlite_integers_is_rejected_not_raised(
    ingestor: Ingestor, store: Store
) -> None:
    birth = Liveness(EDGE, 2**64 - 1, EdgeState.ONLINE)
    outcome = _handle(ingestor, store, _topic(topics.Up.STATE), birth)
    assert outcome.verdict is Verdict.REJECTED


# ---------------------------------------------------------------- liveness and reports


def _edge(store: Store, edge: str = EDGE) -> dict[str, Any]:
    row = store.one("SELECT * FROM edges WHERE edge=?", (edge,))
    assert row is not None
    return row


def test_birth_marks_the_edge_online(ingestor: Ingestor, store: Store) -> None:
    birth = Liveness(EDGE, 3, EdgeState.ONLINE, "0.1.0", "inspect:1", 2)
    assert _handle(ingestor, store, _topic(topics.Up.STATE), birth).verdict is Verdict.STORED
    row = _edge(store)
    assert (row["state"], row["session"], row["serving"], row["config_applied"]) == (
        "online",
        3,
        "inspect:1",
        2,
    )
    assert row["last_seen"] == NOW


def test_a_stale_will_is_ignored_when_a_newer_birth_exists(
    ingestor: Ingestor, store: Store
) -> None:
    state = _topic(topics.Up.STATE)
    _handle(ingestor, store, state, Liveness(EDGE, 1, EdgeState.ONLINE))
    _handle(ingestor, store, state, Liveness(EDGE, 2, EdgeState.ONLINE))
    # The will of session 1 arrives after the birth of session 2 (will-overtakes-rebirth).
    outcome = _handle(ingestor, store, state, Liveness(EDGE, 1, EdgeState.LOST))
    assert outcome.verdict is Verdict.IGNORED
    assert (_edge(store)["state"], _edge(store)["session"]) == ("online", 2)
    # An older birth is stale too.
    outcome = _handle(ingestor, store, state, Liveness(EDGE, 1, EdgeState.ONLINE))
    assert outcome.verdict is Verdict.IGNORED
    assert _edge(store)["session"] == 2
    # The will of the current session counts.
    outcome = _handle(ingestor, store, state, Liveness(EDGE, 2, EdgeState.LOST))
    assert outcome.verdict is Verdict.STORED
    assert (_edge(store)["state"], _edge(store)["session"]) == ("lost", 2)
    assert _rejections(store) == []


def test_a_clean_goodbye_marks_the_edge_offline(ingestor: Ingestor, store: Store) -> None:
    state = _topic(topics.Up.STATE)
    _handle(ingestor, store, state, Liveness(EDGE, 4, EdgeState.ONLINE))
    _handle(ingestor, store, state, Liveness(EDGE, 4, EdgeState.OFFLINE))
    assert _edge(store)["state"] == "offline"


def test_config_reports_never_lower_the_applied_version(ingestor: Ingestor, store: Store) -> None:
    topic = _topic(topics.Up.CONFIG)
    _handle(ingestor, store, topic, ConfigReport(EDGE, ConfigStatus.APPLIED, 3, 3))
    assert (_edge(store)["config_applied"], _edge(store)["config_status"]) == (3, "applied:3")
    _handle(
        ingestor, store, topic, ConfigReport(EDGE, ConfigStatus.REJECTED, 2, 0, "bad_signature: x")
    )
    row = _edge(store)
    assert (row["config_applied"], row["config_status"], row["config_reason"]) == (
        3,
        "rejected:0",
        "bad_signature: x",
    )


def test_deploy_status_is_recorded_as_an_event_and_on_the_edge(
    ingestor: Ingestor, store: Store
) -> None:
    status = DeployStatus(
        EDGE, "d-1", 1, "inspect", 2, DeployStage.FAILED, "hash_mismatch: x", "inspect:1"
    )
    assert _handle(ingestor, store, _topic(topics.Up.DEPLOY), status).verdict is Verdict.STORED
    row = _edge(store)
    assert (row["deploy_id"], row["deploy_stage"], row["deploy_reason"], row["serving"]) == (
        "d-1",
        "failed",
        "hash_mismatch: x",
        "inspect:1",
    )
    assert store.query("SELECT edge, deployment_id, stage FROM deploy_events") == [
        {"edge": EDGE, "deployment_id": "d-1", "stage": "failed"}
    ]


def test_a_report_claiming_another_edge_is_rejected(ingestor: Ingestor, store: Store) -> None:
    report = ConfigReport("st-02", ConfigStatus.APPLIED, 9, 9)
    outcome = _handle(ingestor, store, _topic(topics.Up.CONFIG), report)
    assert (outcome.verdict, outcome.reason) == (Verdict.REJECTED, "invalid")
    assert _edge(store, "st-02")["config_applied"] == 0
    assert _edge(store)["config_applied"] == 0


def test_any_record_batch_updates_last_seen(ingestor: Ingestor, store: Store) -> None:
    """Issue 15: "last seen" stayed frozen while the edge sent telemetry."""
    assert _edge(store)["last_seen"] is None
    _send(ingestor, store, _batch(0, Stream.TELEMETRY))
    assert _edge(store)["last_seen"] == NOW
    late = codec.encode(_batch(1, Stream.TELEMETRY))
    # A batch that waited in a queue does not move it back.
    with IngestTransaction.open(store) as tx:
        outcome = ingestor.handle(tx, _topic(topics.Up.TELEMETRY), late, NOW - 50)
    assert outcome.verdict is Verdict.STORED
    assert _edge(store)["last_seen"] == NOW

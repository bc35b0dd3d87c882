"""Batched scoring: one model call and one commit per batch, each record still durable.

Real ONNX Runtime and real SQLite; the agent's MQTT is never started.
"""

import io
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import build_onnx_model
from PIL import Image

from fedge.bench.inference_setup import make_agent
from fedge.edge_agent.agent import EdgeAgent, ImageFile
from fedge.edge_agent.errors import InferenceError, StorageError
from fedge.edge_agent.group_commit import GroupCommit
from fedge.edge_agent.inference.watcher import InboxWatcher
from fedge.edge_agent.store import LocalStore
from fedge.protocols.records import PredictionRecord, Stream


@pytest.fixture
def agent(tmp_path: Path) -> EdgeAgent:
    model = build_onnx_model(tmp_path / "model.onnx")
    return make_agent(tmp_path / "agent", model, 32)


def _images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((32, 32)).astype(np.float32) for _ in range(n)]


def _png(seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((32, 32)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _persisted(agent: EdgeAgent) -> set[str]:
    """Prediction ids in the agent's file, read through a second connection."""
    with sqlite3.connect(agent.settings.data_dir / "agent.db") as conn:
        return {row[0] for row in conn.execute("SELECT prediction_id FROM predictions")}


def test_a_batch_scores_as_image_by_image_and_is_durable_on_return(agent: EdgeAgent) -> None:
    images = _images(7)
    one_by_one = [agent.score(image).scores for image in images]
    batch = agent.score_many(images, [f"s{i}" for i in range(7)])
    assert [s.record.source for s in batch] == [f"s{i}" for i in range(7)]
    for single, batched in zip(one_by_one, batch, strict=True):
        np.testing.assert_allclose(single, batched.scores, atol=1e-6)
    assert {s.record.prediction_id for s in batch} <= _persisted(agent)
    assert len({s.record.prediction_id for s in batch}) == 7
    assert agent.store.backlog()["pending_records"] == 14


def test_a_batch_is_one_commit(agent: EdgeAgent) -> None:
    before = agent._commits.groups
    agent.score_many(_images(16))
    assert agent._commits.groups == before + 1


def test_an_undecodable_file_fails_alone(agent: EdgeAgent) -> None:
    files = [
        ImageFile(_png(1), ".png", "a"),
        ImageFile(b"not an image", ".png", "b"),
        ImageFile(_png(2), ".png", "c"),
    ]
    results = agent.score_images(files)
    assert isinstance(results[1], InferenceError)
    assert [r.record.source for r in results if not isinstance(r, InferenceError)] == ["a", "c"]
    assert agent.station.counts()["images"] == 2


def test_mismatched_sources_are_refused(agent: EdgeAgent) -> None:
    with pytest.raises(InferenceError, match="2 images but 1 sources"):
        agent.score_many(_images(2), ["only-one"])
    assert agent.store.backlog()["pending_records"] == 0


def test_the_inbox_is_scored_in_batches(agent: EdgeAgent, tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for i in range(10):
        (inbox / f"img-{i:02d}.png").write_bytes(_png(i))
    (inbox / "broken.png").write_bytes(b"garbage")
    watcher = InboxWatcher(agent, inbox, settle_s=0.0, give_up_s=0.0, batch_size=4)
    watcher.scan_once()  # the first scan only sees the files; they settle on the second
    groups = agent._commits.groups
    assert watcher.scan_once() == 10
    assert agent._commits.groups - groups == 3  # 11 settled files in batches of 4
    assert sorted(p.name for p in (inbox / "done").iterdir()) == [
        f"img-{i:02d}.png" for i in range(10)
    ]
    assert [p.name for p in (inbox / "failed").iterdir()] == ["broken.png"]
    assert agent.counters["watch.failed"] == 1


def test_concurrent_writers_share_commits_and_each_returns_durable(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "agent.db")
    commits: GroupCommit[PredictionRecord] = GroupCommit(store.add_predictions)
    returned: list[str] = []
    barrier = threading.Barrier(8)

    def writer(worker: int) -> None:
        barrier.wait()
        for i in range(50):
            record = PredictionRecord(
                f"p-{worker}-{i}", 1.0, "m:1", {"ok": 1.0}, "accept", 0.5, 1, 0.1
            )
            commits.submit([record])
            with sqlite3.connect(tmp_path / "agent.db") as conn:
                found = conn.execute(
                    "SELECT 1 FROM predictions WHERE prediction_id=?", (record.prediction_id,)
                ).fetchone()
            assert found is not None, f"{record.prediction_id} not durable on return"
            returned.append(record.prediction_id)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(returned) == 400
    assert store.backlog()["pending_records"] == 400
    assert commits.groups <= 400
    store.close()


def test_a_failed_group_fails_every_writer_in_it() -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[list[int]] = []

    def write(items: object) -> None:
        batch = list(items)  # type: ignore[call-overload]
        calls.append(batch)
        if batch == [0]:
            entered.set()
            release.wait(5)  # hold the first group open so 1 and 2 queue up behind it
            return
        raise sqlite3.OperationalError("database or disk is full")

    commits: GroupCommit[int] = GroupCommit(write)
    outcomes: dict[int, str] = {}

    def submit(item: int) -> None:
        try:
            commits.submit([item])
            outcomes[item] = "ok"
        except sqlite3.OperationalError as exc:
            outcomes[item] = str(exc)

    first = threading.Thread(target=submit, args=(0,))
    first.start()
    assert entered.wait(5)
    waiters = [threading.Thread(target=submit, args=(i,)) for i in (1, 2)]
    for thread in waiters:
        thread.start()
    while len(commits._pending) < 2:
        threading.Event().wait(0.01)
    release.set()
    for thread in (first, *waiters):
        thread.join(timeout=5)
    assert outcomes == {0: "ok", 1: "database or disk is full", 2: "database or disk is full"}
    assert sorted(calls[1]) == [1, 2]  # the two waiters were one group
    commits_after = commits.groups
    with pytest.raises(sqlite3.OperationalError):
        commits.submit([3])
    assert commits.groups == commits_after + 1


def test_a_full_disk_refuses_new_records_and_keeps_the_durable_ones(tmp_path: Path) -> None:
    """SQLite's max_page_count makes the file full the way a full disk does (SQLITE_FULL)."""
    store = LocalStore(tmp_path / "agent.db")
    record = PredictionRecord("p-0", 1.0, "m:1", {"ok": 1.0}, "accept", 0.5, 1, 0.1)
    store.add_record(Stream.PREDICTIONS, record)
    assert store.seal_batches("st-01", 0, 100) == 1
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count={pages}")
    big = [
        PredictionRecord(f"p-{i}", 1.0, "m:1", {"ok": 1.0}, "accept", 0.5, 1, 0.1, "x" * 500)
        for i in range(1, 400)
    ]
    with pytest.raises(sqlite3.OperationalError, match="full"):
        store.add_predictions(big)
    # Nothing of the failed batch is there, the sealed batch is, and the file works again
    # once there is room.
    assert store.backlog() == {"pending_records": 0, "outbox_batches": 1}
    store._conn.execute("PRAGMA max_page_count=1073741823")
    store.add_predictions(big[:5])
    assert store.backlog() == {"pending_records": 5, "outbox_batches": 1}
    store.close()


def test_a_full_disk_fails_scoring_clearly_and_the_inbox_keeps_the_file(
    agent: EdgeAgent, tmp_path: Path
) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "img.png").write_bytes(_png(0))
    watcher = InboxWatcher(agent, inbox, settle_s=0.0, give_up_s=0.0)
    watcher.scan_once()
    conn = agent.store._conn
    conn.execute(f"PRAGMA max_page_count={conn.execute('PRAGMA page_count').fetchone()[0]}")
    # Fill the file with the smallest predictions there are (no source): once one does
    # not fit, no prediction does.
    filled = 0
    with pytest.raises(StorageError, match=r"is the disk under .* full"):
        while True:
            agent.score_many(_images(1))
            filled += 1
    with pytest.raises(StorageError):
        watcher.scan_once()  # the watch loop logs and counts it; the file stays put
    assert (inbox / "img.png").exists()
    assert agent.counters["store.write_failed"] == 2
    assert agent.store.backlog()["pending_records"] == filled
    conn.execute("PRAGMA max_page_count=1073741823")  # room again
    assert watcher.scan_once() == 1
    assert (inbox / "done" / "img.png").exists()
    assert agent.store.backlog()["pending_records"] == filled + 1


class _Companion:
    """An anomaly model that answers ``answer`` (or raises it)."""

    ref = "inspect-anomaly:1"
    input_dtype = np.float32

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def run(self, batch: np.ndarray) -> object:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_a_failing_anomaly_model_leaves_the_classifiers_records_standing() -> None:
    from fedge.edge_agent.inference.batch import _anomaly_scores

    batch = np.zeros((3, 1, 8, 8), dtype=np.float32)
    scores, _ = _anomaly_scores(_Companion(np.array([1.0, np.inf, 2.0])), None, batch)  # type: ignore[arg-type]
    assert [None if s is None else s.score for s in scores] == [1.0, None, 2.0]
    for broken in (np.zeros((3, 2)), RuntimeError("onnxruntime: bad input")):
        scores, _ = _anomaly_scores(_Companion(broken), None, batch)  # type: ignore[arg-type]
        assert scores == [None, None, None]

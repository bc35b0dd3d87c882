"""Every inbox arrival is scored once, whatever its name (issue 15).

A camera that reuses file names must not lose images; a file scored and committed before
a crash (still in the inbox) must not be scored again. Real ONNX Runtime and SQLite.
"""

import io
import json
import os
import socket
import sqlite3
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import build_onnx_model
from PIL import Image

from fedge.bench.inference_setup import make_agent
from fedge.edge_agent.agent import EdgeAgent, ImageFile
from fedge.edge_agent.errors import InferenceError
from fedge.edge_agent.inference import watcher
from fedge.edge_agent.inference.local_api import serve_local_api
from fedge.edge_agent.inference.watcher import InboxWatcher, arrival_key, free_destination
from fedge.edge_agent.store import LocalStore


@pytest.fixture
def agent(tmp_path: Path) -> EdgeAgent:
    model = build_onnx_model(tmp_path / "model.onnx")
    return make_agent(tmp_path / "agent", model, 32)


def _png(seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((32, 32)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _drop(inbox: Path, name: str, data: bytes) -> None:
    """Write beside the inbox and rename in, as a careful camera does."""
    staged = inbox.parent / f".{name}.tmp"
    staged.write_bytes(data)
    os.replace(staged, inbox / name)


def _settle(scanner: InboxWatcher) -> int:
    scanner.scan_once()  # the first scan sees the files; they settle on the second
    return scanner.scan_once()


def _sources(agent: EdgeAgent) -> list[str]:
    with sqlite3.connect(agent.settings.data_dir / "agent.db") as conn:
        return [row[0] for row in conn.execute("SELECT source FROM predictions ORDER BY at")]


@pytest.fixture
def inbox(tmp_path: Path) -> Path:
    path = tmp_path / "inbox"
    path.mkdir()
    return path


def test_a_reused_name_with_a_new_image_is_scored_again(agent: EdgeAgent, inbox: Path) -> None:
    scanner = InboxWatcher(agent, inbox, settle_s=0.0, give_up_s=0.0)
    _drop(inbox, "part.png", _png(1))
    assert _settle(scanner) == 1
    _drop(inbox, "part.png", _png(2))
    assert _settle(scanner) == 1
    assert _sources(agent) == ["file:part.png", "file:part.png"]
    kept = sorted((inbox / "done").iterdir())
    assert len(kept) == 2  # the second did not overwrite the first
    assert {path.read_bytes() for path in kept} == {_png(1), _png(2)}
    assert agent.counters["watch.already_scored"] == 0


def test_the_same_image_arriving_twice_is_two_parts(agent: EdgeAgent, inbox: Path) -> None:
    scanner = InboxWatcher(agent, inbox, settle_s=0.0, give_up_s=0.0)
    for _ in range(2):
        _drop(inbox, "part.png", _png(7))
        assert _settle(scanner) == 1
    assert len(_sources(agent)) == 2


def test_a_file_committed_before_a_crash_is_moved_not_scored_again(
    agent: EdgeAgent, inbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _drop(inbox, "part.png", _png(3))
    before_crash = InboxWatcher(agent, inbox, settle_s=0.0, give_up_s=0.0)

    def crash(directory: Path, name: str) -> Path:
        raise KeyboardInterrupt("the agent dies between the commit and the move")

    monkeypatch.setattr(watcher, "free_destination", crash)
    with pytest.raises(KeyboardInterrupt):
        _settle(before_crash)
    monkeypatch.undo()
    assert (inbox / "part.png").exists()
    assert len(_sources(agent)) == 1

    after_restart = InboxWatcher(agent, inbox, settle_s=0.0, give_up_s=0.0)
    assert _settle(after_restart) == 0
    assert len(_sources(agent)) == 1
    assert [path.name for path in (inbox / "done").iterdir()] == ["part.png"]
    assert agent.counters["watch.already_scored"] == 1


def test_a_failed_file_does_not_overwrite_an_earlier_one(agent: EdgeAgent, inbox: Path) -> None:
    scanner = InboxWatcher(agent, inbox, settle_s=0.0, give_up_s=0.0)
    for garbage in (b"first", b"second"):
        _drop(inbox, "broken.png", garbage)
        _settle(scanner)
    assert {path.read_bytes() for path in (inbox / "failed").iterdir()} == {b"first", b"second"}


def test_free_destination_never_overwrites(tmp_path: Path) -> None:
    assert free_destination(tmp_path, "a.png") == tmp_path / "a.png"
    (tmp_path / "a.png").write_bytes(b"x")
    other = free_destination(tmp_path, "a.png")
    assert other.parent == tmp_path
    assert other.name.startswith("a~") and other.suffix == ".png"


def test_the_arrival_key_tells_rewrites_apart() -> None:
    key = arrival_key("a.png", 3, 10, 1, b"abc")
    assert key == arrival_key("a.png", 3, 10, 1, b"abc")
    assert key != arrival_key("a.png", 3, 11, 1, b"abc")  # written again
    assert key != arrival_key("a.png", 3, 10, 2, b"abc")  # renamed in anew
    assert key != arrival_key("a.png", 3, 10, 1, b"abd")  # rewritten in place, same tick


def test_an_older_agent_db_gains_the_arrival_column(tmp_path: Path) -> None:
    """A file of an older agent opens, and its inbox predictions still count as scored."""
    path = tmp_path / "agent.db"
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE predictions (prediction_id TEXT PRIMARY KEY, at REAL NOT NULL, "
            "model TEXT NOT NULL, decision TEXT NOT NULL, source TEXT NOT NULL)"
        )
        conn.execute(
            "INSERT INTO predictions VALUES ('p-1', 1000.0, 'm:1', 'accept', 'file:a.png')"
        )
    store = LocalStore(path)
    try:
        # Written before the old agent scored it: the crash case; written later: a reuse.
        assert store.scored_arrival("new-key", "file:a.png", 999.0)
        assert not store.scored_arrival("new-key", "file:a.png", 1001.0)
        assert not store.scored_arrival("new-key", "file:b.png", 999.0)
    finally:
        store.close()
    LocalStore(path).close()  # migrating twice is harmless
    with sqlite3.connect(path) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(predictions)")]
    assert columns.count("arrival") == 1


def test_an_unreadable_image_names_no_python_object(agent: EdgeAgent) -> None:
    (result,) = agent.score_images([ImageFile(b"not an image", ".png", "api")])
    assert isinstance(result, InferenceError)
    assert "object at 0x" not in str(result)
    assert "not a readable image" in str(result)


@pytest.mark.integration
def test_the_local_api_error_names_no_python_object(agent: EdgeAgent) -> None:
    server = serve_local_api(agent, 0)
    try:
        port = server.server_address[1]
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/score", data=b"garbage", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=5)
        assert caught.value.code == 400
        error = json.loads(caught.value.read())["error"]
    finally:
        server.shutdown()
        server.server_close()
    assert "BytesIO" not in error and "object at 0x" not in error
    assert "not a readable image" in error


@pytest.mark.integration
def test_the_local_api_says_retry_later_while_no_model_serves(agent: EdgeAgent) -> None:
    """Chaos finding: a request between a restart that found the only model corrupted and
    the redeployment got 400 Bad Request; nothing is wrong with the request."""
    agent.serving_state.install(None)
    server = serve_local_api(agent, 0)
    try:
        port = server.server_address[1]
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/score", data=b"any image", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=5)
        assert caught.value.code == 503
        assert "no model deployed yet" in json.loads(caught.value.read())["error"]
    finally:
        server.shutdown()
        server.server_close()
    assert agent.counters["api.unavailable"] == 1


@pytest.mark.integration
def test_the_local_api_keeps_the_image_after_its_reply(agent: EdgeAgent) -> None:
    """Issue 25: the reply leaves first (the record is durable before it), then the image
    is handed to the station's store -- also for a client that hung up at once."""
    server = serve_local_api(agent, 0)
    try:
        port = server.server_address[1]
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/score", data=_png(1), method="POST"
        )
        with urllib.request.urlopen(request, timeout=5) as reply:
            record = json.loads(reply.read())
        assert agent.store.has_prediction(record["prediction_id"])  # durable at the reply
        with socket.create_connection(("127.0.0.1", port), timeout=5) as hung_up:
            data = _png(2)
            hung_up.sendall(
                b"POST /v1/score HTTP/1.0\r\nContent-Type: image/png\r\n"
                + f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            hung_up.shutdown(socket.SHUT_RDWR)  # gone before its reply
        deadline = time.monotonic() + 10.0
        while agent.station.counts()["images"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.shutdown()
        server.server_close()
    assert agent.station.flush(timeout=10.0)
    assert agent.station.counts()["images"] == 2
    assert agent.station.image(record["prediction_id"]) is not None
    assert agent.counters["station.keep_failed"] == 0


def test_done_removed_while_watching_is_made_again(agent: EdgeAgent, inbox: Path) -> None:
    """The watcher makes done/ once, not every scan; an operator's cleanup that removes
    it costs nothing: the next scored file makes it again."""
    scanner = InboxWatcher(agent, inbox, settle_s=0.0)
    _drop(inbox, "a.png", _png(1))
    assert _settle(scanner) == 1
    for moved in (inbox / "done").iterdir():
        moved.unlink()
    (inbox / "done").rmdir()
    _drop(inbox, "b.png", _png(2))
    assert _settle(scanner) == 1
    assert [p.name for p in (inbox / "done").iterdir()] == ["b.png"]
    assert not (inbox / "b.png").exists()

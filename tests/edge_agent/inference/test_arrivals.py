"""Inbox files scored on the kernel's word that they arrived whole (Linux inotify).

Real inotify on a real directory, real ONNX Runtime and SQLite: a file renamed in or
closed after writing is scored without the scans' settle time (the watch loop's scan
interval is set far above what the test waits); a file still being written is not; one
closed half-written waits until it is whole; the inbox removed and made again is watched
anew; without inotify the loop polls as before.
"""

import io
import os
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from conftest import build_onnx_model, wait_until
from PIL import Image

from fedge.bench.inference_paths import wait_watched
from fedge.bench.inference_setup import make_agent
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.inference import watcher
from fedge.edge_agent.inference.arrivals import (
    IN_CLOSE_WRITE,
    IN_IGNORED,
    IN_ISDIR,
    IN_MOVED_TO,
    IN_Q_OVERFLOW,
    Arrived,
    open_arrivals,
    parse_events,
)

SLOW_SCAN_S = 30.0  # the loop's scan interval: far longer than any wait below


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[EdgeAgent]:
    model = build_onnx_model(tmp_path / "model.onnx")
    agent = make_agent(tmp_path / "agent", model, 32)
    yield agent
    agent.scorer.close()
    agent.station.close()
    agent.store.close()


def _png(seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((32, 32)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _event(mask: int, name: bytes = b"", pad: int = 16) -> bytes:
    padded = name + b"\0" * (pad - len(name)) if name else b""
    return struct.pack("iIII", 1, mask, 0, len(padded)) + padded


def test_events_name_whole_files_once_and_flag_what_must_be_rescanned() -> None:
    data = (
        _event(IN_CLOSE_WRITE, b"a.png")
        + _event(IN_MOVED_TO, b"b.png")
        + _event(IN_CLOSE_WRITE, b"a.png")  # written again before this read: once
        + _event(IN_MOVED_TO | IN_ISDIR, b"sub")  # a directory moved in: not a file
    )
    assert parse_events(data) == Arrived(("a.png", "b.png"))
    assert parse_events(_event(IN_Q_OVERFLOW)) == Arrived(overflowed=True)
    assert parse_events(_event(IN_IGNORED)) == Arrived(gone=True)
    # A torn read (the kernel never writes one): what came is kept, the rest rescanned.
    assert parse_events(_event(IN_MOVED_TO, b"c.png") + b"\x01\x02") == Arrived(
        ("c.png",), overflowed=True
    )
    assert parse_events(_event(IN_MOVED_TO, b"d.png")[:-4]) == Arrived(overflowed=True)


def test_the_kernel_names_a_file_when_it_is_closed_or_renamed_in(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    arrivals = open_arrivals(inbox)
    assert arrivals is not None, "inotify must be available on the project's Linux hosts"
    with arrivals:
        assert arrivals.wait(0.05) == Arrived()
        with (inbox / "written.png").open("wb") as file:
            file.write(b"half")
            file.flush()
            assert arrivals.wait(0.2) == Arrived()  # open for writing: not whole yet
        assert arrivals.wait(2.0).names == ("written.png",)
        staged = tmp_path / "staged.png"
        staged.write_bytes(b"x")
        os.replace(staged, inbox / "renamed.png")
        (inbox / "done").mkdir()
        assert arrivals.wait(2.0).names == ("renamed.png",)


@contextmanager
def watching(
    agent: EdgeAgent, inbox: Path, interval_s: float = SLOW_SCAN_S, *, events: bool = True
) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=watcher.watch, args=(agent, inbox, stop, interval_s))
    thread.start()
    try:
        if events:
            wait_watched(agent, inbox)
        yield
    finally:
        stop.set()
        thread.join(timeout=interval_s + 10)


def _scored(agent: EdgeAgent) -> list[str]:
    with sqlite3.connect(agent.settings.data_dir / "agent.db") as conn:
        return [row[0] for row in conn.execute("SELECT source FROM predictions ORDER BY at")]


def test_a_file_is_scored_when_it_lands_not_after_a_scan(agent: EdgeAgent, tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    with watching(agent, inbox):  # its first scan is 30 s away
        probes = agent.counters["watch.events"]
        started = time.monotonic()
        staged = tmp_path / "part.png"
        staged.write_bytes(_png(1))
        os.replace(staged, inbox / "part.png")
        (inbox / "direct.png").write_bytes(_png(2))  # written in place and closed
        wait_until(lambda: _scored(agent), 10, "both files scored", expect=lambda s: len(s) == 2)
        took = time.monotonic() - started
        moved = inbox / "done"
        wait_until(
            lambda: len(list(moved.glob("*.png"))), 10, "both moved", expect=lambda n: n == 2
        )
    assert sorted(_scored(agent)) == ["file:direct.png", "file:part.png"]
    assert took < SLOW_SCAN_S / 3  # on the events, not the scan (seconds at most, loaded)
    assert sorted(p.name for p in (inbox / "done").iterdir()) == ["direct.png", "part.png"]
    assert agent.counters["watch.events"] >= probes + 2


def test_a_file_closed_half_written_is_scored_once_when_whole(
    agent: EdgeAgent, tmp_path: Path
) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    image = _png(3)
    with watching(agent, inbox):
        probes = agent.counters["watch.events"]
        with (inbox / "slow.png").open("wb") as file:
            file.write(image[: len(image) // 2])
        # Its event came; it does not decode, so it waits (not failed: a writer that
        # paused has give_up_s to finish).
        wait_until(
            lambda: agent.counters["watch.events"],
            10,
            "the half file's event",
            expect=lambda n: n > probes,
        )
        time.sleep(0.3)
        assert _scored(agent) == []
        assert not any((inbox / "failed").glob("*"))
        with (inbox / "slow.png").open("ab") as file:
            file.write(image[len(image) // 2 :])
        wait_until((inbox / "done" / "slow.png").exists, 10, "slow.png moved", expect=bool)
    assert _scored(agent) == ["file:slow.png"]
    assert [p.read_bytes() for p in (inbox / "done").iterdir()] == [image]


def test_an_inbox_removed_and_made_again_is_watched_anew(agent: EdgeAgent, tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    with watching(agent, inbox):
        (inbox / "a.png").write_bytes(_png(4))
        # Moved, not only scored: the move follows the commit.
        wait_until((inbox / "done" / "a.png").exists, 10, "a.png scored and moved", expect=bool)
        for path in sorted(inbox.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        inbox.rmdir()
        wait_until(inbox.exists, 10, "the watcher to make the inbox again", expect=bool)
        wait_watched(agent, inbox)  # a new watch on the new directory
        (inbox / "b.png").write_bytes(_png(5))
        wait_until(lambda: _scored(agent), 10, "b.png scored", expect=lambda s: len(s) == 2)
    assert _scored(agent) == ["file:a.png", "file:b.png"]


def test_without_inotify_the_inbox_is_polled(
    agent: EdgeAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watcher, "open_arrivals", lambda directory: None)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    with watching(agent, inbox, interval_s=0.05, events=False):
        (inbox / "polled.png").write_bytes(_png(6))
        wait_until(lambda: _scored(agent), 10, "polled.png scored", expect=bool)
    assert _scored(agent) == ["file:polled.png"]
    assert agent.counters["watch.events"] == 0

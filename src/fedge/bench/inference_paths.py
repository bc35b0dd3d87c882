"""The single-image paths a line camera uses, each against its fair baseline (issue 25).

One image at a time, through what a station really runs, PNG bytes in:

- ``library``: ``agent.score_image(png)`` -- decode and preprocess as the manifest says,
  one ORT call, the record committed to agent.db, the image kept in the station's store;
- ``api``: ``POST /v1/score`` to the agent's local API, one request per image on a new
  connection (HTTP/1.0, as the API speaks), the record durable before the reply, sent
  and timed by a camera in its own process (:mod:`fedge.bench.camera`), as a line's
  software is;
- ``inbox``: the file is renamed into the watched directory; the watcher reads the
  kernel's event for it (inotify, :mod:`fedge.edge_agent.inference.arrivals`), scores it,
  commits the record with its arrival key and moves the file to ``done/``, as the agent's
  watch loop does on Linux;
- ``inbox-scan``: the same through the watcher's two scans instead (the first sees the
  file, the second finds it settled), as where no event comes (a network file system);
  the file's mtime is set back past the settle time so that no sleep is timed, only the
  watcher's own work.

The baseline does the same decode + preprocess (:func:`fedge.party.preprocess.prepare`)
and ``session.run`` on the same model with the agent's SessionOptions (one intra-op
thread), and stores nothing: in this process for ``library`` and ``inbox`` (which
reads the landed file's bytes first), and behind a bare standard-library
``ThreadingHTTPServer`` endpoint for ``api``, so both sides pay an HTTP round trip and the
ratio is what fedge adds.

Two agents are timed: one whose station already keeps ``kept`` images (filled through
``score_images`` before timing, so agent.db and the station store hold as many) and a
fresh one; ``growth`` is the first's median over the second's. Rounds interleave the
sides, rotating which goes first; p50 and p99 are over every image of every round.
"""

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from fedge.bench import Progress
from fedge.bench.testbed import BenchError
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.inference.arrivals import open_arrivals
from fedge.edge_agent.inference.local_api import bind_local_api, start_local_api
from fedge.edge_agent.inference.scorer import ImageFile
from fedge.edge_agent.inference.watcher import InboxWatcher, watch
from fedge.party.preprocess import prepare
from fedge.protocols.manifest import Preprocess

PATHS = ("library", "api", "inbox", "inbox-scan")
TARGET_RATIO = 1.3  # median, agent / baseline
TARGET_P99_RATIO = 2.0
TARGET_GROWTH = 1.1  # median at --kept N over --kept 0
FILL_BATCH = 32

# One image through a side: its PNG bytes in, ms out.
Timed = Callable[[bytes], float]


def fill(agent: EdgeAgent, pngs: Sequence[bytes], kept: int, progress: Progress) -> None:
    """Score ``kept`` images through ``score_images`` (batches, as the inbox scores a burst)
    so the station keeps ``kept`` images and agent.db indexes as many predictions."""
    for start in range(0, kept, FILL_BATCH):
        if start % 1024 == 0:
            progress(f"filling the station: {start}/{kept} images kept")
        files = [
            ImageFile(pngs[(start + i) % len(pngs)], ".png", f"fill:{start + i}")
            for i in range(min(FILL_BATCH, kept - start))
        ]
        for result in agent.score_images(files):
            if isinstance(result, Exception):
                raise BenchError(f"filling the station failed: {result}")
    if not agent.station.settled(timeout=120.0):
        raise BenchError("the station's retention did not catch up within 120 s")


# ---------------------------------------------------------------- the baseline


class Baseline:
    """Decode + preprocess + ``session.run`` for one image: nothing stored."""

    def __init__(self, session: ort.InferenceSession, spec: Preprocess) -> None:
        self.session = session
        self.spec = spec
        self.input_name = session.get_inputs()[0].name
        self.output_name = session.get_outputs()[0].name

    def scores(self, data: bytes) -> np.ndarray:
        image = prepare(data, self.spec)
        (probs,) = self.session.run([self.output_name], {self.input_name: image[None]})
        return np.asarray(probs[0])


@contextmanager
def baseline_server(baseline: Baseline) -> Iterator[int]:
    """A bare ``http.server`` endpoint scoring the POSTed image; yields its port."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            reply = json.dumps({"scores": baseline.scores(body).tolist()}).encode()
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="bench-baseline", daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


class Camera:
    """The camera's process (:mod:`fedge.bench.camera`), holding ``pngs``: each call has
    it POST one of them and returns the milliseconds it measured."""

    def __init__(self, pngs: Sequence[bytes], directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for index, data in enumerate(pngs):
            (directory / f"{index:06d}.png").write_bytes(data)
        self._index = {data: index for index, data in enumerate(pngs)}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "fedge.bench.camera", str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def post(self, port: int, data: bytes) -> float:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(f"{port} {self._index[data]}\n")
        self._process.stdin.flush()
        reply = self._process.stdout.readline().strip()
        if not reply or reply.startswith("error"):
            raise BenchError(f"the camera process failed: {reply or 'it exited'}")
        return float(reply)

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


@contextmanager
def camera(pngs: Sequence[bytes], directory: Path) -> Iterator[Camera]:
    client = Camera(pngs, directory)
    try:
        yield client
    finally:
        client.close()


# ---------------------------------------------------------------- the sides per path


class _Lander:
    """Lands files in a directory as a camera does: written aside, renamed in, aged past
    the watcher's settle time (untimed)."""

    def __init__(self, directory: Path, staging: Path) -> None:
        self.directory = directory
        self.staging = staging
        directory.mkdir(parents=True, exist_ok=True)
        staging.mkdir(parents=True, exist_ok=True)
        self.n = 0

    def land(self, data: bytes) -> Path:
        self.n += 1
        name = f"cam-{self.n:07d}.png"
        staged = self.staging / name
        staged.write_bytes(data)
        aged = time.time() - 5.0
        os.utime(staged, (aged, aged))
        target = self.directory / name
        os.replace(staged, target)
        return target


def library_side(agent: EdgeAgent) -> Timed:
    def timed(data: bytes) -> float:
        started = time.perf_counter()
        agent.score_image(data, suffix=".png", source="bench")
        return (time.perf_counter() - started) * 1000.0

    return timed


def library_baseline(baseline: Baseline) -> Timed:
    def timed(data: bytes) -> float:
        started = time.perf_counter()
        baseline.scores(data)
        return (time.perf_counter() - started) * 1000.0

    return timed


@contextmanager
def inbox_side(agent: EdgeAgent, root: Path) -> Iterator[Timed]:
    lander = _Lander(root / "inbox", root / "staging")
    watcher = InboxWatcher(agent, root / "inbox")
    arrivals = open_arrivals(root / "inbox")
    if arrivals is None:
        raise BenchError("no inotify on this host: time the scans with --path inbox-scan")

    def timed(data: bytes) -> float:
        path = lander.land(data)
        started = time.perf_counter()
        scored = watcher.score_arrived(arrivals.wait(1.0).names)
        elapsed = (time.perf_counter() - started) * 1000.0
        if scored != 1 or path.exists():
            raise BenchError(f"the watcher did not score {path.name} on its event")
        return elapsed

    try:
        yield timed
    finally:
        arrivals.close()


ARRIVALS_TIMED = 40


def wait_watched(agent: EdgeAgent, inbox: Path, timeout_s: float = 20.0) -> None:
    """Until a running watch loop's inotify watch on ``inbox`` is in place: probe files
    (no image suffix: never scored) are written until one is counted as an event. A
    sleep would race the loop's start on a loaded host, and a file landing before the
    watch waits for the scans instead."""
    seen = agent.counters["watch.events"]
    deadline = time.monotonic() + timeout_s
    n = 0
    while agent.counters["watch.events"] == seen:
        if time.monotonic() > deadline:
            raise BenchError(f"the watch loop saw no event in {inbox} within {timeout_s:g} s")
        n += 1
        (inbox / f"probe-{n}.txt").write_bytes(b"")
        time.sleep(0.05)
    time.sleep(0.1)  # the probes still queued are read before what is timed


def arrival_latency(
    agent: EdgeAgent, root: Path, pngs: Sequence[bytes], *, events: bool, count: int
) -> dict[str, Any]:
    """ms from a file's rename into the inbox to its move to ``done/`` (its record durable),
    through the agent's own watch loop at its defaults, on inotify's events or on the
    scans alone: what a line waits for a part's verdict, settle time included."""
    inbox, staging = root / "inbox", root / "staging"
    inbox.mkdir(parents=True, exist_ok=True)
    staging.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    loop = threading.Thread(
        target=watch, args=(agent, inbox, stop), kwargs={"events": events}, daemon=True
    )
    loop.start()
    waited: list[float] = []
    try:
        if events:
            wait_watched(agent, inbox)
        for n in range(count):
            staged, target = staging / f"cam-{n:05d}.png", inbox / f"cam-{n:05d}.png"
            staged.write_bytes(pngs[n % len(pngs)])
            started = time.perf_counter()
            os.replace(staged, target)
            deadline = started + 30.0
            while target.exists():
                if time.perf_counter() > deadline:
                    raise BenchError(f"{target.name} was not scored within 30 s")
                time.sleep(0.0002)
            waited.append((time.perf_counter() - started) * 1000.0)
    finally:
        stop.set()
        loop.join(timeout=10)
    return {
        "events": events,
        "files": count,
        "p50_ms": round(float(np.percentile(waited, 50)), 3),
        "p99_ms": round(float(np.percentile(waited, 99)), 3),
    }


def inbox_scan_side(agent: EdgeAgent, root: Path) -> Timed:
    watcher = InboxWatcher(agent, root / "inbox")
    lander = _Lander(root / "inbox", root / "staging")

    def timed(data: bytes) -> float:
        path = lander.land(data)
        started = time.perf_counter()
        first = watcher.scan_once()  # sees the file
        second = watcher.scan_once()  # finds it settled: scored, committed, moved
        elapsed = (time.perf_counter() - started) * 1000.0
        if first != 0 or second != 1 or path.exists():
            raise BenchError(f"the watcher did not score {path.name} on its second scan")
        return elapsed

    return timed


def inbox_baseline(baseline: Baseline, root: Path) -> Timed:
    lander = _Lander(root / "baseline-inbox", root / "baseline-staging")

    def timed(data: bytes) -> float:
        path = lander.land(data)
        started = time.perf_counter()
        baseline.scores(path.read_bytes())
        elapsed = (time.perf_counter() - started) * 1000.0
        path.unlink()
        return elapsed

    return timed


def api_side(client: Camera, port: int) -> Timed:
    return lambda data: client.post(port, data)


@contextmanager
def agent_api(agent: EdgeAgent) -> Iterator[int]:
    server = bind_local_api(agent, 0)
    start_local_api(server)
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- timing and summary


@dataclass
class Sides:
    """The timed sides of one path: the full agent, the fresh agent (or None), the baseline."""

    full: Timed
    fresh: Timed | None
    baseline: Timed


def time_sides(
    sides: Sides,
    pngs: Sequence[bytes],
    *,
    rounds: int,
    per_round: int,
    warmup: int,
    progress: Progress,
    label: str,
) -> dict[str, list[list[float]]]:
    """ms per image of every side, per round; rounds rotate which side goes first."""
    named: list[tuple[str, Timed]] = [("agent", sides.full), ("baseline", sides.baseline)]
    if sides.fresh is not None:
        named.append(("agent_kept_0", sides.fresh))
    for _, side in named:
        for i in range(warmup):
            side(pngs[i % len(pngs)])
    samples: dict[str, list[list[float]]] = {name: [] for name, _ in named}
    for r in range(rounds):
        progress(f"{label}: round {r + 1}/{rounds}")
        order = named[r % len(named) :] + named[: r % len(named)]
        for name, side in order:
            picks = [pngs[(r * per_round + i) % len(pngs)] for i in range(per_round)]
            samples[name].append([side(data) for data in picks])
    return samples


def _stats(rounds: list[list[float]]) -> dict[str, Any]:
    pooled = np.asarray([v for values in rounds for v in values])
    return {
        "p50_ms": round(float(np.percentile(pooled, 50)), 4),
        "p99_ms": round(float(np.percentile(pooled, 99)), 4),
        "mean_ms": round(float(pooled.mean()), 4),
        "median_per_round_ms": [round(statistics.median(values), 4) for values in rounds],
        "images": int(pooled.size),
    }


def summarise(path: str, kept: int, samples: dict[str, list[list[float]]]) -> dict[str, Any]:
    agent, baseline = _stats(samples["agent"]), _stats(samples["baseline"])
    fresh = _stats(samples["agent_kept_0"]) if "agent_kept_0" in samples else agent
    ratio = agent["p50_ms"] / baseline["p50_ms"]
    p99_ratio = agent["p99_ms"] / baseline["p99_ms"]
    growth = agent["p50_ms"] / fresh["p50_ms"]
    return {
        "path": path,
        "kept": kept,
        "ratio": round(ratio, 4),
        "p99_ratio": round(p99_ratio, 4),
        "growth": round(growth, 4),
        "met_target": ratio <= TARGET_RATIO
        and p99_ratio <= TARGET_P99_RATIO
        and growth <= TARGET_GROWTH,
        "targets": {"ratio": TARGET_RATIO, "p99_ratio": TARGET_P99_RATIO, "growth": TARGET_GROWTH},
        "agent": agent,
        "agent_kept_0": fresh,
        "baseline": baseline,
        "ratio_per_round": [
            round(a / b, 4)
            for a, b in zip(
                agent["median_per_round_ms"], baseline["median_per_round_ms"], strict=True
            )
        ],
    }

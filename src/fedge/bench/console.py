"""``fedge bench console``: the fleet page at fleet scale, and how soon a change shows.

One run, on a real manager home (mutual TLS, SQLite), a real Mosquitto, ``manager
serve``'s service, one real agent (the live edge) and the console served by uvicorn
over HTTP, logged in as an operator:

- **fleet page**: ``GET /`` for a plant-like fleet of ``edges`` (``console_fleet``:
  online, lost and never-seen stations, two models, configs applied and pending,
  predictions, labels and gaps, all through the manager's real ingest), p50/p95 over
  ``samples`` requests: its first page as an operator opens it (100 rows, issue 25) and
  the whole fleet on one page (``?per=1000``), each with the server's own split from its
  Server-Timing header (reading the store vs rendering the rows). Peers side by side: a
  static file through the same server (the HTTP floor) and the page's table queries
  alone, in process (``fleet_table``).
- **live update**: a threshold set through the library (as the console's form does)
  until an open ``/events`` stream shows the live edge's report of it applied:
  manager -> broker -> agent -> broker -> manager's store -> the console's poll -> the
  page. Split in two: until serve stored the agent's report (the peer: the fleet path
  without the console), and from the report stored to the event on the stream (what the
  console adds: its poll, 0.5 s).

- **labelling** (issue 30, console_labels.py): a station's image fetched on demand
  through the manager, and an operator labelling in Chromium until the next item's
  image shows, each beside its peer.

Targets (issue 14): fleet page p95 <= 300 ms at 1,000 edges, live update <= 1 s; (issue
30) label p95 <= 300 ms, image view p95 <= 500 ms.
"""

import json
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import uvicorn

from fedge.bench import console_labels
from fedge.bench.console_fleet import MODEL, VERSIONS, fill, plan, publish_models
from fedge.bench.console_shot import fleet_page_screenshot
from fedge.bench.machine import machine_info
from fedge.console import accounts
from fedge.console.accounts import Role
from fedge.console.app import create_app
from fedge.console.fleet_table import DEFAULT_PER_PAGE, PER_PAGE, fleet_table
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.settings import load_settings
from fedge.edge_agent.viewing.server import bind_image_server
from fedge.edge_manager.fleet.operations import opened
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.reports import store as report_store
from fedge.edge_manager.security.enrollment import enroll, managed_broker
from fedge.edge_manager.serve import ManagerService
from fedge.transport.ports import free_port

LIVE_EDGE = "st-live"
PAGE_TARGET_MS = 300.0
LIVE_TARGET_MS = 1000.0
POLL_S = 0.5  # how often an open /events stream looks at the store (create_app's default)
Progress = Callable[[str], None]


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000.0
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p95_ms": round(float(np.percentile(ms, 95)), 2),
        "max_ms": round(float(ms.max()), 2),
        "n": len(seconds),
    }


def _setup(home: ManagerHome, root: Path, edges: int) -> str:
    """A plant-like fleet of ``edges`` - 1 stations (console_fleet) and the live edge's
    agent config; the models published."""
    with opened(home) as fleet:
        publish_models(fleet, root)
        toml = root / LIVE_EDGE / "agent.toml"
        toml.parent.mkdir()
        # Its image endpoint on (issue 30): the label figures fetch its images.
        agent_toml = enroll(home, fleet, LIVE_EDGE, root / LIVE_EDGE / "data")
        toml.write_text(f"image_port = {free_port()}\n{agent_toml}")
        fill(fleet, [plan(i) for i in range(1, edges)], time.time())
    return str(toml)


def _deploy_live(home: ManagerHome) -> None:
    """The live edge serves inspect:2 (a real deployment: download, verify, swap), so
    its thresholds are set for the model it runs, as a plant's are."""
    with opened(home) as fleet:
        deployment = fleet.deploy(MODEL, VERSIONS[-1], [LIVE_EDGE])
        deadline = time.monotonic() + 60
        while report_store.active_edges(fleet.store, deployment, edge=LIVE_EDGE) != 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{LIVE_EDGE} did not activate {MODEL}:{VERSIONS[-1]}")
            time.sleep(0.05)


class _Server:
    def __init__(self, home: ManagerHome) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            create_app(home, poll_s=POLL_S),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="console", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("the console did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _login(client: httpx.Client, token: str) -> None:
    page = client.get("/login")
    csrf = page.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    response = client.post("/login", data={"csrf": csrf, "token": token})
    if response.status_code != 303:
        raise RuntimeError(f"login refused: {response.status_code}")


class _Events(threading.Thread):
    """Reads the page's live-update stream; remembers when each cell text first showed."""

    def __init__(self, base: str, cookies: httpx.Cookies) -> None:
        super().__init__(name="sse", daemon=True)
        self.client = httpx.Client(base_url=base, cookies=cookies, timeout=None)
        # the live edge's "config" cell -> when first seen (perf clock, wall clock)
        self.seen: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            with self.client.stream("GET", "/events") as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    cells = json.loads(line[6:])["edges"].get(LIVE_EDGE, {})
                    with self.lock:
                        self.seen.setdefault(
                            str(cells.get("config")), (time.perf_counter(), time.time())
                        )
        except httpx.HTTPError:
            return  # the server shut down

    def first(self, text: str) -> tuple[float, float] | None:
        with self.lock:
            return self.seen.get(text)


def run_console_bench(
    edges: int = 1000,
    samples: int = 50,
    changes: int = 30,
    progress: Progress = lambda _: None,
    screenshot: Path | None = None,
    labels: int = 20,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fedge-bench-console-") as tmp:
        root = Path(tmp)
        home = ManagerHome(root / "home")
        home.init(
            ManagerSettings(
                "bench",
                broker_port=free_port(),
                grpc_port=free_port(),
                superlink_port=free_port(),
                enroll_port=free_port(),
                metrics_port=free_port(),
            )
        )
        progress(f"filling a fleet of {edges} edges through the manager's ingest")
        toml = Path(_setup(home, root, edges))
        with opened(home) as fleet:
            token = accounts.add_token(fleet.store, "bench", Role.OPERATOR)
            predictions = report_store.prediction_count(fleet.store)
        broker = managed_broker(home)
        broker.start()
        service = ManagerService(home)
        agent = EdgeAgent(load_settings(toml))
        images = bind_image_server(agent)
        try:
            service.start()
            agent.start()
            if images is not None:
                images.start()
            progress(f"deploying {MODEL}:{VERSIONS[-1]} to {LIVE_EDGE}")
            _deploy_live(home)
            with _Server(home) as base, httpx.Client(base_url=base, timeout=30) as client:
                _login(client, token)
                progress("timing the fleet page")
                # The page as an operator opens it (its first page of rows), and the
                # whole fleet on one page (the issue-14 page, before paging).
                page = _time_page(client, "/", samples, min(edges, DEFAULT_PER_PAGE))
                whole = _time_page(client, f"/?per={PER_PAGE[-1]}", samples, edges)
                static = _time_page(client, "/static/console.css", samples)
                query = _time_query(home, samples)
                progress("timing live updates")
                events = _Events(base, client.cookies)
                events.start()
                live, store, store_to_page = _time_live(home, events, changes, progress)
                progress(f"timing image views and labels on {LIVE_EDGE}")
                ids = console_labels.prepare(home, agent, LIVE_EDGE, labels + 5)
                view, direct = console_labels.time_views(home, client, LIVE_EDGE, agent, ids)
                label, post = console_labels.time_labels(base, token, LIVE_EDGE, labels, progress)
                if screenshot is not None:
                    progress(f"screenshot of the fleet page to {screenshot}")
                    fleet_page_screenshot(base, token, screenshot)
                # Logging out ends the live stream (the server checks the session) before
                # the server stops, rather than having its shutdown cut it.
                fleet_html = client.get("/").text
                csrf = fleet_html.split('name="csrf" value="', 1)[1].split('"', 1)[0]
                client.post("/logout", data={"csrf": csrf})
                events.join(timeout=5)
        finally:
            if images is not None:
                images.stop()
            agent.stop()
            service.stop()
            broker.stop()
    result = {
        "benchmark": "console",
        "machine": machine_info(),
        "edges": edges,
        "predictions": predictions,
        "fleet_page_p95_ms": page["p95_ms"],
        "fleet_page_p50_ms": page["p50_ms"],
        "fleet_page_whole_p95_ms": whole["p95_ms"],
        "live_update_p95_ms": live["p95_ms"],
        "live_update_p50_ms": live["p50_ms"],
        "fleet_page": page,
        "fleet_page_rows": min(edges, DEFAULT_PER_PAGE),
        "fleet_page_whole": whole,
        "peer_static_file": static,
        "peer_table_queries": query,
        "fleet_page_vs_static_p95": round(page["p95_ms"] / static["p95_ms"], 2),
        "fleet_page_vs_queries_p95": round(page["p95_ms"] / query["p95_ms"], 2),
        "live_update": live,
        "peer_store_applied": store,
        "store_to_page": store_to_page,
        "live_vs_store_p95": round(live["p95_ms"] / store["p95_ms"], 2),
        **console_labels.figures(view, direct, label, post),
        "targets": {
            "fleet_page_p95_ms": PAGE_TARGET_MS,
            "live_update_p95_ms": LIVE_TARGET_MS,
            "label_p95_ms": console_labels.LABEL_TARGET_MS,
            "image_view_p95_ms": console_labels.VIEW_TARGET_MS,
        },
    }
    result["met_target"] = (
        page["p95_ms"] <= PAGE_TARGET_MS
        and live["p95_ms"] <= LIVE_TARGET_MS
        and label["p95_ms"] <= console_labels.LABEL_TARGET_MS
        and view["p95_ms"] <= console_labels.VIEW_TARGET_MS
    )
    return result


def _time_page(
    client: httpx.Client, path: str, samples: int, expect_rows: int | None = None
) -> dict[str, Any]:
    """p50/p95 of ``GET path`` in the client; for a console page also the server's own
    split (its Server-Timing header): reading the store, and rendering the rows."""
    for _ in range(2):  # warm-up: templates compiled, connections open
        client.get(path)
    times = []
    parts: dict[str, list[float]] = {}
    for _ in range(samples):
        started = time.perf_counter()
        response = client.get(path)
        times.append(time.perf_counter() - started)
        if response.status_code != 200:
            raise RuntimeError(f"GET {path}: {response.status_code}")
        if expect_rows is not None and response.text.count("<tr data-edge=") != expect_rows:
            raise RuntimeError(f"GET {path} did not show {expect_rows} edges")
        for part in filter(None, response.headers.get("server-timing", "").split(",")):
            name, _, duration = part.strip().partition(";dur=")
            parts.setdefault(name, []).append(float(duration) / 1000.0)
    stats: dict[str, Any] = dict(_stats(times))
    for name, seconds in parts.items():
        stats[f"server_{name}"] = _stats(seconds)
    return stats


def _time_query(home: ManagerHome, samples: int) -> dict[str, float]:
    times = []
    with opened(home) as fleet:
        for _ in range(samples):
            started = time.perf_counter()
            fleet_table(fleet)
            times.append(time.perf_counter() - started)
    return _stats(times)


def _time_live(
    home: ManagerHome, events: "_Events", changes: int, progress: Progress
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per change: set until shown (perf clock); set until stored, and stored until
    shown, from the store's own record of when serve stored the report (wall clock, the
    same machine)."""
    live: list[float] = []
    store: list[float] = []
    store_to_page: list[float] = []
    # Each change waits a random part of the console's poll first: changes made right
    # after an event would all land at the same point of the poll's cycle (just after
    # one poll) and measure nearly the whole period each time, not what a change made
    # at any moment sees.
    phase = random.Random(0)
    with opened(home) as fleet:
        for index in range(changes):
            time.sleep(phase.uniform(0.0, POLL_S))
            started, started_wall = time.perf_counter(), time.time()
            version = fleet.set_threshold([LIVE_EDGE], 0.5 + index / 100)[0].version
            shown = f"v{version} / v{version}"
            deadline = started + 30
            while (seen := events.first(shown)) is None:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"the page never showed {LIVE_EDGE} at {shown}")
                time.sleep(0.005)
            row = report_store.edge_state(fleet.store, LIVE_EDGE)
            status = None if row is None else row.config_status
            # A report stores its status and time together: applied:N has a time.
            if row is None or row.config_reported_at is None or status != f"applied:{version}":
                raise RuntimeError(f"{LIVE_EDGE} reported {status}, not applied:{version}")
            live.append(seen[0] - started)
            store.append(row.config_reported_at - started_wall)
            store_to_page.append(seen[1] - row.config_reported_at)
            progress(f"live update {index + 1}/{changes}: {live[-1] * 1000:.0f} ms")
    return _stats(live), _stats(store), _stats(store_to_page)

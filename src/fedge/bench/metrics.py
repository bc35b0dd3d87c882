"""``fedge bench metrics``: the manager's ``/metrics`` at fleet scale, and what it costs ingest.

Set-up (not measured): a temporary manager home with ``edges`` enrolled stations, each
with a birth stored (state, session, last seen: the rows a scrape aggregates), a real
Mosquitto, :class:`ManagerService` in this process and publisher processes
(:mod:`fedge.bench.ingest_publisher`) for ``publishing`` of the stations.

Measured, per repeat, side by side on fresh testbeds: the same telemetry ingest (records
per second until the store holds every one, as ``fedge bench ingest`` measures it) once
with metrics off (``metrics_port = 0``) and once with them served and scraped every
``scrape_interval_s`` by a client in this process meanwhile; then ``idle_scrapes`` more
scrapes with nothing else running. ``scrape_p95_ms`` is the p95 of every scrape of the
runs with metrics (under ingest and idle); ``ingest_ratio`` is the median rate with
metrics over the median rate without. Target: p95 <= 100 ms at 1,000 stations and ingest
within 5 % (ratio >= 0.95). The liveness sweep is off in both, so the stored births stay
``online`` (the rows a fleet of live stations has).
"""

import dataclasses
import statistics
import threading
import time
import urllib.request
from typing import Any

from fedge.bench import Progress, no_progress
from fedge.bench.config_push import ratio
from fedge.bench.ingest import _wait_for_records
from fedge.bench.ingest_publisher import PublisherSpec
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError, HelperProcess, Testbed, wait_until
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.reports import store as report_store
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.transport.ports import free_port

TARGET_SCRAPE_P95_MS = 100.0
TARGET_INGEST_RATIO = 0.95
PUBLISHER_MODULE = "fedge.bench.ingest_publisher"


def run_metrics(
    edges: int = 1000,
    *,
    records: int = 400_000,
    publishing: int = 8,
    publishers: int = 2,
    batch_records: int = 500,
    repeats: int = 3,
    scrape_interval_s: float = 1.0,
    idle_scrapes: int = 100,
    timeout_s: float = 300.0,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    if edges < publishing or publishing < 1 or publishers < 1 or repeats < 1:
        raise BenchError("need edges >= publishing >= 1, publishers >= 1 and repeats >= 1")
    if records % publishing:
        raise BenchError(f"records ({records}) must divide evenly over {publishing} edges")
    machine = machine_info()
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for repeat in range(repeats):
        for metrics in (False, True):

            def step(line: str, repeat: int = repeat, metrics: bool = metrics) -> None:
                side = "with metrics" if metrics else "without metrics"
                progress(f"run {repeat + 1}/{repeats} {side}: {line}")

            runs[metrics].append(
                _one_run(
                    edges,
                    records,
                    publishing,
                    min(publishers, publishing),
                    batch_records,
                    metrics=metrics,
                    scrape_interval_s=scrape_interval_s,
                    idle_scrapes=idle_scrapes,
                    timeout_s=timeout_s,
                    progress=step,
                )
            )
    scrapes = [ms for run in runs[True] for ms in run["scrape_ms"]]
    loaded = [ms for run in runs[True] for ms in run["scrape_ms_under_ingest"]]
    p95 = _p95(scrapes)
    rate_with = statistics.median(r["records_per_s"] for r in runs[True])
    rate_without = statistics.median(r["records_per_s"] for r in runs[False])
    ingest_ratio = ratio(rate_with, rate_without)
    exact = all(r["lost"] == 0 and r["duplicated"] == 0 for side in runs.values() for r in side)
    return {
        "benchmark": "metrics",
        "edges": edges,
        "scrape_p95_ms": round(p95, 2),
        "scrape_p95_ms_under_ingest": round(_p95(loaded), 2) if loaded else None,
        "scrape_median_ms": round(statistics.median(scrapes), 2),
        "scrapes": len(scrapes),
        "metrics_bytes": runs[True][-1]["metrics_bytes"],
        "ingest_ratio": ingest_ratio,
        "records_per_s_with_metrics": round(rate_with),
        "records_per_s_without_metrics": round(rate_without),
        "met_target": p95 <= TARGET_SCRAPE_P95_MS
        and ingest_ratio is not None
        and ingest_ratio >= TARGET_INGEST_RATIO
        and exact,
        "target": {"scrape_p95_ms": TARGET_SCRAPE_P95_MS, "ingest_ratio": TARGET_INGEST_RATIO},
        "settings": {
            "records": records,
            "publishing_edges": publishing,
            "publishers": publishers,
            "batch_records": batch_records,
            "repeats": repeats,
            "scrape_interval_s": scrape_interval_s,
            "idle_scrapes": idle_scrapes,
        },
        "runs": {"without_metrics": runs[False], "with_metrics": runs[True]},
        "measured": (
            "scrape: GET /metrics of manager serve (in-process, loopback), wall time to the "
            "last byte, every scrape during ingest and after it; ingest: first publish -> "
            "the store holds every record, median over repeats, metrics off vs on and scraped"
        ),
        "machine": machine,
    }


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def _scrape(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
    return (time.perf_counter() - started) * 1000.0, len(body)


def _births(bed: Testbed) -> None:
    """Every station online with a session and a last-seen time, as live ones are."""
    now = time.time()
    with IngestTransaction.open(bed.store) as tx:
        for edge in bed.edges:
            tx.went_online(edge, Liveness(edge, 1, EdgeState.ONLINE, "bench", "", 0, now), now)


def _one_run(
    edges: int,
    records: int,
    publishing: int,
    publishers: int,
    batch_records: int,
    *,
    metrics: bool,
    scrape_interval_s: float,
    idle_scrapes: int,
    timeout_s: float,
    progress: Progress,
) -> dict[str, Any]:
    with Testbed(edges, progress=progress) as bed:
        port = free_port() if metrics else 0
        bed.home.save_settings(
            dataclasses.replace(bed.settings, metrics_port=port, edge_lost_after_s=0.0)
        )
        _births(bed)
        bed.start_broker()
        service = bed.start_service()
        assert bed.broker is not None
        url = f"http://127.0.0.1:{port}/metrics"
        if metrics and service.metrics_server is None:
            raise BenchError(f"manager serve did not serve metrics on port {port}")
        helpers: list[HelperProcess] = []
        loaded: list[float] = []
        stop = threading.Event()
        sizes: list[int] = []

        def scrape_meanwhile() -> None:
            while not stop.wait(scrape_interval_s):
                ms, size = _scrape(url)
                loaded.append(ms)
                sizes.append(size)

        scraper = threading.Thread(target=scrape_meanwhile, name="bench-scraper", daemon=True)
        try:
            for index in range(publishers):
                group = bed.edges[:publishing][index::publishers]
                spec = PublisherSpec(
                    host=bed.broker.host,
                    port=bed.broker.port,
                    fleet=bed.settings.fleet,
                    edges=[bed.logins[edge] for edge in group],
                    records_per_edge=records // publishing,
                    batch_records=batch_records,
                    duplicate_fraction=0.0,
                    seed=index,
                )
                helpers.append(
                    HelperProcess(
                        PUBLISHER_MODULE, spec.to_json(), bed.root / f"publisher-{index}.log"
                    )
                )
            ready = [helper.wait_event("ready", timeout_s) for helper in helpers]
            messages = sum(int(r["messages"]) for r in ready)
            baseline = service.counters["stored"] + service.counters["duplicate"]
            progress(f"publishing {records} records from {publishing} of {edges} stations")
            if metrics:
                scraper.start()
            for helper in helpers:
                helper.send('{"cmd": "go"}')
            end = _wait_for_records(bed, records, timeout_s)
            published = [helper.wait_event("published", timeout_s) for helper in helpers]
            start = min(float(p["first_publish_at"]) for p in published)
            wait_until(
                lambda: (
                    service.counters["stored"] + service.counters["duplicate"] - baseline
                    >= messages
                ),
                timeout_s,
                "the manager to process every message",
            )
        finally:
            stop.set()
            if scraper.is_alive():
                scraper.join(timeout=15)
            for helper in helpers:
                helper.stop()
        idle: list[float] = []
        if metrics:
            progress(f"{idle_scrapes} scrapes at rest")
            for _ in range(idle_scrapes):
                ms, size = _scrape(url)
                idle.append(ms)
                sizes.append(size)
        total = report_store.telemetry_count(bed.reader())
        distinct = report_store.distinct_telemetry_count(bed.reader())
    if end is None:
        raise BenchError(f"the store did not hold all {records} records within {timeout_s} s")
    seconds = end - start
    return {
        "metrics": metrics,
        "records_per_s": round(records / seconds),
        "seconds": round(seconds, 3),
        "lost": records - int(distinct),
        "duplicated": int(total) - int(distinct),
        "scrape_ms": [round(ms, 3) for ms in loaded + idle],
        "scrape_ms_under_ingest": [round(ms, 3) for ms in loaded],
        "metrics_bytes": max(sizes) if sizes else 0,
    }

"""Ingest: telemetry records per second into the manager's store, exactly once.

Set-up (not measured): a temporary manager home with a few enrolled edges, a real
Mosquitto, :class:`ManagerService` in this process, and publisher processes
(:mod:`fedge.bench.ingest_publisher`) that have encoded every :class:`RecordBatch` and
connected one MQTT session per edge.

Measured: from the first publish (the earliest of the publishers' clocks) until the
manager's store holds every record (the ``batches`` rows that commit with the records
are polled; ``count(*) FROM telemetry`` then confirms). About 1 % of the batches are
published twice, as a QoS 1 redelivery after a reconnect would be; the manager must
store them once. After every message has been processed:
``lost`` = expected - distinct stored (edge, seq, idx), ``duplicated`` = stored rows -
distinct ones.

Transport: passwords on plain TCP, or with ``tls`` both, side by side: each repeat runs
the plain fleet and then a fresh mutual-TLS one (issue 13: every publisher session
presents its edge's certificate from the fleet CA), so load on the machine falls on both
alike; the result holds both and the ratio TLS / plain of the median rates.
"""

import statistics
import time
from typing import Any

from fedge.bench import Progress, no_progress
from fedge.bench.config_push import ratio
from fedge.bench.ingest_publisher import PublisherSpec
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError, HelperProcess, Testbed, wait_until
from fedge.edge_manager.reports import store as report_store

TARGET_RECORDS_PER_S = 50_000
PUBLISHER_MODULE = "fedge.bench.ingest_publisher"
POLL_S = 0.02


def run_ingest(
    records: int = 200_000,
    *,
    repeats: int = 3,
    edges: int = 8,
    publishers: int = 2,
    batch_records: int = 500,
    duplicate_fraction: float = 0.01,
    timeout_s: float = 300.0,
    tls: bool = False,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Run the benchmark ``repeats`` times, each on a fresh testbed; medians and worst cases.

    With ``tls`` the top-level figures are the mutual-TLS runs'; ``plain`` holds the
    plain runs' (interleaved with them) and ``tls_over_plain`` the ratio of the rates.
    """
    if records < edges or edges < 1 or publishers < 1 or batch_records < 1 or repeats < 1:
        raise BenchError("need records >= edges >= 1, and publishers, batch_records, repeats >= 1")
    if records % edges:
        raise BenchError(f"records ({records}) must divide evenly over {edges} edges")
    machine = machine_info()
    publishers = min(publishers, edges)
    transports = (False, True) if tls else (False,)
    runs: dict[bool, list[dict[str, Any]]] = {use_tls: [] for use_tls in transports}
    for repeat in range(repeats):
        for use_tls in transports:

            def step(line: str, repeat: int = repeat, use_tls: bool = use_tls) -> None:
                name = "mutual TLS " if use_tls else ("plain " if tls else "")
                progress(f"{name}run {repeat + 1}/{repeats}: {line}")

            runs[use_tls].append(
                _one_run(
                    records,
                    edges,
                    publishers,
                    batch_records,
                    duplicate_fraction,
                    timeout_s,
                    use_tls,
                    step,
                )
            )
    settings = {
        "batch_records": batch_records,
        "repeats": repeats,
        "edges": edges,
        "publishers": publishers,
        "duplicate_fraction": duplicate_fraction,
    }
    plain = {**_summary(records, runs[False], False), **settings}
    if not tls:
        return {"benchmark": "ingest", **plain, "machine": machine}
    mutual = {**_summary(records, runs[True], True), **settings}
    return {
        "benchmark": "ingest",
        **mutual,
        "plain": plain,
        "tls_over_plain": {"records_per_s": ratio(mutual["records_per_s"], plain["records_per_s"])},
        "machine": machine,
    }


def _summary(records: int, runs: list[dict[str, Any]], tls: bool) -> dict[str, Any]:
    """One transport's figures over its runs: the median rate, the worst lost/duplicated."""
    rates = [r["records_per_s"] for r in runs]
    rate = None if None in rates else statistics.median(rates)
    return {
        "transport": "mutual TLS" if tls else "plain",
        "records": records,
        "records_per_s": None if rate is None else round(rate),
        "seconds": None if rate is None else round(records / rate, 3),
        # Exactly-once must hold in every run, so the worst run is reported.
        "lost": max(r["lost"] for r in runs),
        "duplicated": max(r["duplicated"] for r in runs),
        "target_records_per_s": TARGET_RECORDS_PER_S,
        "met_target": rate is not None
        and rate >= TARGET_RECORDS_PER_S
        and all(r["lost"] == 0 and r["duplicated"] == 0 for r in runs),
        "runs": runs,
        "measured": (
            "first publish -> the manager's store holds every record (committed), median over "
            "repeats; publishers pre-encode their batches like the agent's outbox"
        ),
    }


def _one_run(
    records: int,
    edges: int,
    publishers: int,
    batch_records: int,
    duplicate_fraction: float,
    timeout_s: float,
    tls: bool,
    progress: Progress,
) -> dict[str, Any]:
    with Testbed(edges, tls=tls, progress=progress) as bed:
        bed.start_broker()
        broker = bed.broker_auth()
        service = bed.start_service()
        assert bed.broker is not None
        helpers: list[HelperProcess] = []
        try:
            progress(f"encoding {records} records in {publishers} publisher processes")
            for index in range(publishers):
                group = bed.edges[index::publishers]
                spec = PublisherSpec(
                    host=bed.broker.host,
                    port=bed.broker.port,
                    fleet=bed.settings.fleet,
                    edges=[bed.logins[edge] for edge in group],
                    records_per_edge=records // edges,
                    batch_records=batch_records,
                    duplicate_fraction=duplicate_fraction,
                    seed=index,
                )
                helpers.append(
                    HelperProcess(
                        PUBLISHER_MODULE, spec.to_json(), bed.root / f"publisher-{index}.log"
                    )
                )
            ready = [helper.wait_event("ready", timeout_s) for helper in helpers]
            messages = sum(int(r["messages"]) for r in ready)
            batches = sum(int(r["batches"]) for r in ready)
            duplicates_sent = sum(int(r["duplicates"]) for r in ready)
            baseline = service.counters["stored"] + service.counters["duplicate"]

            progress(f"publishing {batches} batches (+{duplicates_sent} sent twice)")
            for helper in helpers:
                helper.send('{"cmd": "go"}')
            end = _wait_for_records(bed, records, timeout_s)
            published = [helper.wait_event("published", timeout_s) for helper in helpers]
            start = min(float(p["first_publish_at"]) for p in published)

            progress("waiting for every message (duplicates too) to be processed")
            wait_until(
                lambda: (
                    service.counters["stored"] + service.counters["duplicate"] - baseline
                    >= messages
                ),
                timeout_s,
                "the manager to process every message",
            )
        finally:
            for helper in helpers:
                helper.stop()
        total = report_store.telemetry_count(bed.reader())
        distinct = report_store.distinct_telemetry_count(bed.reader())
        rejected = report_store.rejection_count(bed.reader())
        duplicates_dropped = report_store.duplicates_dropped(bed.reader(), "telemetry")
        gaps = report_store.gap_count(bed.reader())
    seconds = None if end is None else end - start
    rate = None if seconds is None else records / seconds
    return {
        "records_per_s": None if rate is None else round(rate),
        "seconds": None if seconds is None else round(seconds, 3),
        "lost": records - distinct,
        "duplicated": total - distinct,
        "batches": batches,
        "duplicates_sent": duplicates_sent,
        "duplicates_dropped": duplicates_dropped,
        "rejected": rejected,
        "gaps": gaps,
        "publish_seconds": round(max(float(p["last_publish_at"]) for p in published) - start, 3),
        "broker_acked_seconds": _acked_seconds(published, start),
        "broker": broker,
    }


def _wait_for_records(bed: Testbed, records: int, timeout_s: float) -> float | None:
    """Wall-clock time at which the store held ``records`` telemetry records, or None."""
    # The batches rows commit in the same transaction as their records and are few, so
    # polling them is cheap. Not too often, though: every wake-up of this thread competes
    # for the GIL with the manager's writer we are measuring. The end time is the first
    # poll that sees everything, so it errs on the slow side by at most POLL_S.
    try:
        wait_until(
            lambda: report_store.batched_records(bed.reader(), ("telemetry",)) >= records,
            timeout_s,
            "all records",
            POLL_S,
        )
    except BenchError:
        return None
    end = time.time()
    if report_store.telemetry_count(bed.reader()) < records:
        raise BenchError("batches say every record is stored but the telemetry table disagrees")
    return end


def _acked_seconds(published: list[dict[str, Any]], start: float) -> float | None:
    acked = [p["all_acked_at"] for p in published]
    if any(a is None for a in acked):
        return None
    return round(max(float(a) for a in acked) - start, 3)

"""Config push: how long from a threshold change to every edge's report in the manager's store.

Set-up (not measured): a temporary manager home with N enrolled edges, a real Mosquitto
with the fleet's ACLs, :class:`ManagerService` in this process, and N simulated edges
(real MQTT sessions, one per edge, authenticated as that edge) spread over worker
processes (:mod:`fedge.bench.config_push_worker`). Every edge first receives and applies
the retained config v1, so each measured push is a change, not a first connect.

Transport: passwords on plain TCP, or with ``tls`` both -- first the plain fleet, then a
fresh one on mutual TLS (issue 13: the broker requires each edge's certificate from the
fleet CA, the manager connects with its own) -- reported side by side with the ratios
TLS / plain of the medians, so the price of TLS is measured on the same machine in the
same invocation.

Measured, per repeat: ``fleet.set_threshold(all_edges, t)`` commits the new version for
every edge in one store transaction (t0 = when it returns); the manager's serve loop
signs-and-publishes the retained documents, each edge verifies, decides, persists and
reports, and the manager ingests the report. An edge's latency is the manager's ingest
time of its report (``edges.config_reported_at``) minus t0. The breakdown says where the
time goes: t0 -> manager's publish acknowledged by the broker, -> edge received the
document, -> edge published its report, -> manager stored it.
"""

import statistics
import time
from typing import Any

import numpy as np

from fedge.bench import Progress, no_progress
from fedge.bench.config_push_worker import WorkerSpec
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError, HelperProcess, Testbed, wait_until
from fedge.edge_manager.fleet.edge_view_store import ReportedEdge
from fedge.edge_manager.reports import store as report_store

TARGET_P99_S = 2.0
WORKER_MODULE = "fedge.bench.config_push_worker"
# Latencies come from the store's own timestamps, so polling only decides when a push is
# over; polling slowly keeps this thread from taking the GIL from the manager it measures.
POLL_S = 0.025


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    array = np.asarray(values, dtype=np.float64)
    return {
        "p50_s": round(float(np.percentile(array, 50)), 4),
        "p99_s": round(float(np.percentile(array, 99)), 4),
        "max_s": round(float(array.max()), 4),
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return None if not present else round(statistics.median(present), 4)


def _split(items: list[str], parts: int) -> list[list[str]]:
    return [items[i::parts] for i in range(parts) if items[i::parts]]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator rounded, or None when either is missing or zero."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 4)


def run_config_push(
    edges: int = 1000,
    *,
    repeats: int = 3,
    workers: int = 4,
    threshold: float = 0.72,
    timeout_s: float = 60.0,
    tls: bool = False,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result (see the module docstring).

    With ``tls`` the top-level figures are the mutual-TLS run's; ``plain`` holds the
    plain run's and ``tls_over_plain`` the ratios of their p50 and p99.
    """
    if edges < 1 or repeats < 1 or workers < 1:
        raise BenchError("edges, repeats and workers must all be at least 1")
    machine = machine_info()

    def measure(secure: bool) -> dict[str, Any]:
        name = "mutual TLS" if secure else "plain"

        def step(line: str) -> None:
            progress(f"{name}: {line}" if tls else line)

        return _measure(edges, repeats, workers, threshold, timeout_s, secure, step)

    plain = measure(False)
    if not tls:
        return {"benchmark": "config-push", **plain, "machine": machine}
    secure = measure(True)
    return {
        "benchmark": "config-push",
        **secure,
        "plain": plain,
        "tls_over_plain": {
            "p50": ratio(secure["p50_s"], plain["p50_s"]),
            "p99": ratio(secure["p99_s"], plain["p99_s"]),
        },
        "machine": machine,
    }


def _measure(
    edges: int,
    repeats: int,
    workers: int,
    threshold: float,
    timeout_s: float,
    tls: bool,
    progress: Progress,
) -> dict[str, Any]:
    """One fleet (plain or mutual TLS) on a fresh testbed: its figures, no machine."""
    with Testbed(edges, tls=tls, progress=progress) as bed:
        bed.start_broker()
        broker = bed.broker_auth()
        # v1 is in the store before the service starts: its first loop publishes it.
        bed.fleet.set_threshold(bed.edges, 0.5)
        bed.start_service()
        helpers: list[HelperProcess] = []
        runs: list[dict[str, Any]] = []
        try:
            progress(f"connecting {edges} simulated edges in {workers} worker processes")
            assert bed.broker is not None
            for index, group in enumerate(_split(bed.edges, workers)):
                spec = WorkerSpec(
                    host=bed.broker.host,
                    port=bed.broker.port,
                    fleet=bed.settings.fleet,
                    public_key=bed.public_key,
                    edges=[bed.logins[edge] for edge in group],
                    store_path=str(bed.root / f"worker-{index}" / "agent.db"),
                )
                helpers.append(
                    HelperProcess(WORKER_MODULE, spec.to_json(), bed.root / f"worker-{index}.log")
                )
            tls_sessions = 0
            for helper in helpers:
                tls_sessions += int(helper.wait_event("ready", timeout_s)["tls_sessions"])
                helper.wait_event("applied", timeout_s, version=1)
            progress("waiting for the manager to store every edge's v1 report")
            wait_until(
                lambda: report_store.edges_applied(bed.reader(), 1) == edges,
                timeout_s,
                "the v1 reports",
            )
            wait_until(
                lambda: report_store.unpublished_desired(bed.reader()) == 0,
                timeout_s,
                "the v1 publish acknowledgements",
            )
            for repeat in range(repeats):
                value = round(threshold + 0.01 * repeat, 4)
                progress(f"push {repeat + 1}/{repeats}: threshold {value} to {edges} edges")
                runs.append(_one_push(bed, value, timeout_s))
        finally:
            timings: list[list[Any]] = []
            errors = 0
            for helper in helpers:
                helper.stop()
                event = helper.find("timings")
                if event is not None:
                    timings.extend(event["rows"])
                    errors += int(event.get("errors", 0))
        _add_edge_breakdown(runs, timings)
    return {
        "transport": "mutual TLS" if tls else "plain",
        "edges": edges,
        "workers": len(helpers),
        "repeats": repeats,
        "p50_s": _median([r["p50_s"] for r in runs]),
        "p99_s": _median([r["p99_s"] for r in runs]),
        "max_s": _median([r["max_s"] for r in runs]),
        "converged": min(r["converged"] for r in runs),
        "target_p99_s": TARGET_P99_S,
        "met_target": all(r["converged"] == edges for r in runs)
        and (_median([r["p99_s"] for r in runs]) or float("inf")) <= TARGET_P99_S,
        "edge_errors": errors,
        "broker": broker,
        "edge_sessions_on_tls": tls_sessions,
        "runs": runs,
        "measured": (
            "per edge: manager's ingest time of the edge's ConfigReport (edges."
            "config_reported_at) minus the commit of fleet.set_threshold; figures are "
            "medians over repeats"
        ),
    }


def _one_push(bed: Testbed, value: float, timeout_s: float) -> dict[str, Any]:
    n = len(bed.edges)
    pushed = bed.fleet.set_threshold(bed.edges, value)
    t0 = time.time()  # set_threshold returns once its transaction committed
    versions = {p.edge: p.version for p in pushed}
    version = max(versions.values())
    if min(versions.values()) != version:
        raise BenchError(f"edges are at different desired versions: {sorted(set(versions))}")
    try:
        wait_until(
            lambda: report_store.edges_applied(bed.reader(), version) == n,
            timeout_s,
            f"all edges to report v{version}",
            POLL_S,
        )
        all_visible_s: float | None = time.time() - t0
    except BenchError:
        all_visible_s = None  # reported below as converged < edges
    converged = [r for r in report_store.edge_states(bed.reader()) if r.config_applied == version]
    stored = [_reported_at(r) - t0 for r in converged]
    published = [at - t0 for at in report_store.config_published_at(bed.reader(), version)]
    return {
        "version": version,
        "threshold": value,
        "t0": t0,
        **_stats(stored),
        "converged": len(converged),
        "all_visible_s": None if all_visible_s is None else round(all_visible_s, 4),
        "breakdown": {"manager_publish_acked": _stats(published)},
    }


def _reported_at(row: ReportedEdge) -> float:
    """When the manager stored ``row``'s config report (an edge at a version reported it)."""
    if row.config_reported_at is None:
        raise BenchError(f"{row.edge} is at config v{row.config_applied} but sent no report")
    return row.config_reported_at


def _add_edge_breakdown(runs: list[dict[str, Any]], timings: list[list[Any]]) -> None:
    """Add the edge side (received, reported, report acked) to each run's breakdown."""
    by_version: dict[int, list[list[Any]]] = {}
    for row in timings:
        by_version.setdefault(int(row[1]), []).append(row)
    for run in runs:
        rows = by_version.get(run["version"], [])
        t0 = run.pop("t0")
        for name, column in (("edge_received", 2), ("edge_reported", 3), ("edge_report_acked", 4)):
            run["breakdown"][name] = _stats([r[column] - t0 for r in rows if r[column] is not None])
        run["breakdown"]["manager_stored"] = {k: run[k] for k in ("p50_s", "p99_s", "max_s")}

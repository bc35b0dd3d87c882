"""A job's Prometheus metrics, read from its run store when scraped (issue 27, item 1).

The job process (a ServerApp inside the SuperLink, or ``fedge sim``'s runner) is left
untouched: it records every round in the run store as it ends (jobs/run_store.py), and
:class:`JobCollector` turns those records into metric families on each scrape, opening
the store read-only for the scrape's length. Whoever waits on the job serves them
(:func:`serve_job_metrics`; ``federation/fleet_job.py`` while a fleet job runs).

Series, one set per run in the store (label ``run``), named by Prometheus' rules:

- ``fedge_job_rounds_completed_total``: rounds recorded;
- ``fedge_job_round_duration_seconds``: a histogram of the rounds' times (wall seconds on
  the fleet, virtual ones in simulation), and ``fedge_job_last_round_duration_seconds``;
- ``fedge_job_round_parties{outcome}``: the newest round's parties by outcome
  (``selected``, ``on_time``, ``late``, ``failed``: late and dropped parties);
- ``fedge_job_parties_total{outcome}``: the same over every round;
- ``fedge_job_epsilon_spent{station}``: the privacy a station spent in the job (DP-SGD
  stations' own reports; ``run_store.CENTRAL_DP_ROW`` for a central-DP job's station-level epsilon);
- ``fedge_job_state{state}``: 1 for the run's state.
"""

import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from fedge.aggregator.errors import AggregatorError
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.transport.metrics import MetricsServer, Readiness

log = logging.getLogger(__name__)

OUTCOMES = ("selected", "on_time", "late", "failed")
# Round times from a second to an hour: a fleet round takes tens of seconds to minutes.
DURATION_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


def round_histogram(durations: list[float]) -> tuple[list[tuple[str, float]], float]:
    """Pure: Prometheus' cumulative buckets (``le`` -> count, ending at ``+Inf``) and the
    sum of ``durations``."""
    buckets = [(str(le), float(sum(1 for d in durations if d <= le))) for le in DURATION_BUCKETS]
    buckets.append(("+Inf", float(len(durations))))
    return buckets, float(sum(durations))


class JobCollector(Collector):
    """Reads the run store at ``path`` on every scrape; a store that cannot be read yields
    no job series and is logged (a scrape never fails for it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterator[Metric]:
        try:
            runs = self._read()
        except (sqlite3.Error, OSError, ValueError, AggregatorError) as exc:
            log.warning("job metrics: cannot read the run store %s: %s", self.path, exc)
            return
        completed = CounterMetricFamily(
            "fedge_job_rounds_completed", "Rounds the job has recorded.", labels=["run"]
        )
        duration = HistogramMetricFamily(
            "fedge_job_round_duration_seconds",
            "Round times (wall seconds on the fleet, virtual ones in simulation).",
            labels=["run"],
        )
        last = GaugeMetricFamily(
            "fedge_job_last_round_duration_seconds",
            "The newest round's time.",
            labels=["run"],
        )
        parties = GaugeMetricFamily(
            "fedge_job_round_parties",
            "The newest round's parties by outcome (late and failed: late and dropped).",
            labels=["run", "outcome"],
        )
        parties_total = CounterMetricFamily(
            "fedge_job_parties",
            "Parties by outcome over every round of the job.",
            labels=["run", "outcome"],
        )
        epsilon = GaugeMetricFamily(
            "fedge_job_epsilon_spent",
            "Differential-privacy epsilon a station spent in the job.",
            labels=["run", "station"],
        )
        state = GaugeMetricFamily(
            "fedge_job_state", "The run's state (1).", labels=["run", "state"]
        )
        for run_id, run_state, rounds, spent in runs:
            completed.add_metric([run_id], float(len(rounds)))
            times = [float(r["round_time_s"]) for r in rounds]
            buckets, total = round_histogram(times)
            duration.add_metric([run_id], buckets, total)
            if rounds:
                newest = rounds[-1]
                last.add_metric([run_id], float(newest["round_time_s"]))
                for outcome in OUTCOMES:
                    parties.add_metric([run_id, outcome], float(len(newest[outcome])))
            for outcome in OUTCOMES:
                count = sum(len(r[outcome]) for r in rounds)
                parties_total.add_metric([run_id, outcome], float(count))
            for row in spent:
                epsilon.add_metric([run_id, str(row["name"])], float(row["epsilon_job"]))
            for name in RunState:
                state.add_metric([run_id, name.value], 1.0 if name.value == run_state else 0.0)
        yield from (completed, duration, last, parties, parties_total, epsilon, state)

    def _read(self) -> list[tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]]:
        if not self.path.exists():  # not created yet: the job has not started
            return []
        store = RunStore.read_only(self.path)  # a scrape never writes the job's store
        try:
            return [
                (
                    str(run["run_id"]),
                    str(run["state"]),
                    store.rounds(str(run["run_id"])),
                    store.privacy_spent(str(run["run_id"])),
                )
                for run in store.runs()
            ]
        finally:
            store.close()


def job_registry(run_store: Path) -> CollectorRegistry:
    """A registry of its own (never prometheus_client's global one) holding the job's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(run_store))
    return registry


def serve_job_metrics(run_store: Path, host: str, port: int) -> MetricsServer:
    """``/metrics`` (with ``/healthz``, and ``/readyz`` always ready) for the job whose run
    store is ``run_store``, bound on ``host:port`` (loopback: the series name stations),
    serving once :meth:`MetricsServer.start` is called."""
    return MetricsServer(
        job_registry(run_store), lambda: Readiness({}), host, port, name="job-metrics"
    )

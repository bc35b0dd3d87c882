"""The agent's Prometheus metrics, served on its local API (``/metrics``, issue 27).

Read when scraped from what the agent keeps anyway -- its counters, its outbox, its
serving state, the privacy report its ClientApp leaves, its certificate -- except the
inference latency, which no store keeps: :class:`AgentMetrics` owns a histogram the scorer's
observer feeds (one ``observe`` per image, about a microsecond). Every series carries the
``edge`` label, so one Prometheus can sum or compare the fleet. One registry per agent,
never prometheus_client's global one.
"""

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fedge.party.privacy_status import read_spent
from fedge.protocols import pki

log = logging.getLogger(__name__)

# Seconds; a station's CPU budget is 2 s per image (CruX), a GPU's a few milliseconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True)
class AgentReadings:
    """What the collector reads from the running agent (called on a scrape thread)."""

    counters: Callable[[], Mapping[str, int]]
    backlog: Callable[[], Mapping[str, int]]
    oldest_unsent_at: Callable[[], float | None]
    serving: Callable[[], str]
    config_version: Callable[[], int]
    broker_connected: Callable[[], bool]
    desired_via_grpc: Callable[[], bool]
    data_dir: Path
    cert_file: Path | None


class _AgentCollector(Collector):
    def __init__(self, edge: str, readings: AgentReadings) -> None:
        self.edge = edge
        self.readings = readings
        self._cert: tuple[float, float | None] = (-1.0, None)

    def _gauge(self, name: str, help_text: str, value: float) -> Metric:
        family = GaugeMetricFamily(name, help_text, labels=["edge"])
        family.add_metric([self.edge], value)
        return family

    def collect(self) -> Iterator[Metric]:
        r, edge = self.readings, self.edge
        counters = dict(r.counters())
        predictions = CounterMetricFamily(
            "fedge_agent_predictions_total",
            "Images scored and recorded since the agent started, by decision.",
            labels=["edge", "decision"],
        )
        for key, n in sorted(counters.items()):
            if key.startswith("decision."):
                predictions.add_metric([edge, key.removeprefix("decision.")], n)
        yield predictions
        errors = CounterMetricFamily(
            "fedge_agent_inference_errors_total",
            "Images the model failed on since the agent started.",
            labels=["edge"],
        )
        errors.add_metric([edge], counters.get("inference.errors", 0))
        yield errors
        backlog = r.backlog()
        yield self._gauge(
            "fedge_agent_outbox_batches",
            "Sealed batches waiting for the manager's acknowledgement.",
            backlog.get("outbox_batches", 0),
        )
        yield self._gauge(
            "fedge_agent_pending_records",
            "Records not sealed into a batch yet.",
            backlog.get("pending_records", 0),
        )
        oldest = r.oldest_unsent_at()
        yield self._gauge(
            "fedge_agent_outbox_oldest_unsent_age_seconds",
            "Age of the oldest record the manager has not acknowledged (0: none).",
            0.0 if oldest is None else max(0.0, time.time() - oldest),
        )
        model = GaugeMetricFamily(
            "fedge_agent_model_info",
            "The model this station serves (always 1).",
            labels=["edge", "model"],
        )
        model.add_metric([edge, r.serving() or "none"], 1)
        yield model
        yield self._gauge(
            "fedge_agent_config_applied_version",
            "The version of the config in force.",
            r.config_version(),
        )
        yield self._gauge(
            "fedge_agent_broker_connected", "1 while connected to the broker.", r.broker_connected()
        )
        yield self._gauge(
            "fedge_agent_desired_via_grpc",
            "1 while desired documents are polled over gRPC.",
            r.desired_via_grpc(),
        )
        spent = read_spent(r.data_dir)
        if spent is not None:
            yield self._gauge(
                "fedge_agent_privacy_epsilon_spent",
                "Epsilon this station spent over every job (at its ledger's delta).",
                spent.epsilon,
            )
        not_after = self._not_after()
        if not_after is not None:
            yield self._gauge(
                "fedge_certificate_not_after_timestamp_seconds",
                "When this station's certificate expires (it renews it before).",
                not_after,
            )

    def _not_after(self) -> float | None:
        path = self.readings.cert_file
        if path is None:
            return None
        try:
            mtime = path.stat().st_mtime
            if self._cert[0] != mtime:
                info = pki.cert_info(pki.load_certificate(path.read_bytes()))
                self._cert = (mtime, info.not_after.timestamp())
        except Exception as exc:  # a scrape never fails on an unreadable certificate
            log.warning("metrics: cannot read certificate %s: %s", path, exc)
            return None
        return self._cert[1]


class AgentMetrics:
    """One agent's registry: the read-when-scraped collector and the latency histogram."""

    def __init__(self, edge: str) -> None:
        self.edge = edge
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = Histogram(
            "fedge_agent_inference_latency_seconds",
            "Model time per image (the batch's time divided among its images).",
            labelnames=["edge"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(edge=edge)

    def read(self, readings: AgentReadings) -> None:
        """Register what is read when scraped (once the agent's parts exist)."""
        self.registry.register(_AgentCollector(self.edge, readings))

    def observe_latencies(self, latencies_ms: Sequence[float]) -> None:
        for latency in latencies_ms:
            self.latency.observe(latency / 1000.0)

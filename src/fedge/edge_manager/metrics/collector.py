"""The manager's Prometheus metrics, read when scraped (issue 27).

:class:`ManagerCollector` turns what serve already keeps -- its counters, its store's
health, its broker link -- and aggregate reads of the store (store.py) into metric
families; nothing is counted twice on the ingest path. Names follow Prometheus' rules:
``fedge_`` prefix, base units in the name, ``_total`` on counters, ``_timestamp_seconds``
for moments (a certificate's expiry: days left is ``(x - time()) / 86400`` in PromQL).
Counters kept in serve's memory (records stored, messages by verdict) start again at 0
when serve restarts, which Prometheus' ``rate()`` expects; batches and duplicates come
from the store's own per-stream tallies and survive restarts.
"""

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fedge.edge_manager.metrics.store import FleetReadings, MetricsReader
from fedge.protocols import pki

log = logging.getLogger(__name__)

# serve's verdicts, as counted per message (ingest/checks.py's Verdict values).
VERDICTS = ("stored", "duplicate", "rejected", "ignored")


@dataclass(frozen=True)
class ServeReadings:
    """What the collector reads from the running serve, each a plain callable (it is
    called on a scrape thread: attribute reads and dict copies only)."""

    counters: Callable[[], Mapping[str, int]]
    ingest_counters: Callable[[], Mapping[str, int]]
    held: Callable[[], int]
    store_state: Callable[[], str]
    broker_connected: Callable[[], bool]


class _CertificateFiles:
    """The home's certificate files (CA, servers, manager and operator clients) and its
    CRL, parsed again only when a file changed."""

    def __init__(self, pki_dir: Path) -> None:
        self.pki_dir = pki_dir
        self._parsed: dict[Path, tuple[float, tuple[str, str, float] | None]] = {}
        self._crl: tuple[float, float | None] = (-1.0, None)

    def certificates(self) -> list[tuple[str, str, float]]:
        found = []
        paths = [self.pki_dir / "ca.crt", *sorted(self.pki_dir.glob("*/*.crt"))]
        for path in paths:
            entry = self._certificate(path)
            if entry is not None:
                found.append(entry)
        return found

    def _certificate(self, path: Path) -> tuple[str, str, float] | None:
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return None
        cached = self._parsed.get(path)
        if cached is not None and cached[0] == mtime:
            return cached[1]
        entry: tuple[str, str, float] | None
        try:
            info = pki.cert_info(pki.load_certificate(path.read_bytes()))
            role = "ca" if path.name == "ca.crt" else (info.role or path.parent.name)
            entry = (info.identity, str(role), info.not_after.timestamp())
        except Exception as exc:  # an unreadable file is logged, never a failed scrape
            log.warning("metrics: cannot read certificate %s: %s", path, exc)
            entry = None
        self._parsed[path] = (mtime, entry)
        return entry

    def crl_next_update(self) -> float | None:
        path = self.pki_dir / "crl.pem"
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return None
        if self._crl[0] != mtime:
            try:
                crl = x509.load_pem_x509_crl(path.read_bytes())
                next_update = crl.next_update_utc
                self._crl = (mtime, None if next_update is None else next_update.timestamp())
            except ValueError as exc:
                log.warning("metrics: cannot read the CRL %s: %s", path, exc)
                self._crl = (mtime, None)
        return self._crl[1]


class ManagerCollector(Collector):
    def __init__(self, serve: ServeReadings, db_path: Path, pki_dir: Path) -> None:
        self.serve = serve
        self.reader = MetricsReader(db_path)
        self.files = _CertificateFiles(pki_dir)

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        yield from self._serve_metrics()
        try:
            readings = self.reader.read()
        except Exception as exc:  # the store's metrics are left out; serve's still come
            log.warning("metrics: cannot read the store: %s", exc)
        else:
            yield from _fleet_metrics(readings)
            yield from self._certificates(readings)
        scrape = GaugeMetricFamily(
            "fedge_manager_metrics_collect_seconds", "Time spent collecting these metrics."
        )
        scrape.add_metric([], time.perf_counter() - started)
        yield scrape

    def _serve_metrics(self) -> Iterator[Metric]:
        counters, ingest = dict(self.serve.counters()), dict(self.serve.ingest_counters())
        records = CounterMetricFamily(
            "fedge_manager_ingest_records_total",
            "Records stored since serve started, by stream.",
            labels=["stream"],
        )
        for key, n in sorted(ingest.items()):
            if key.startswith("stored.") and key != "stored.liveness":
                records.add_metric([key.removeprefix("stored.")], n)
        yield records
        messages = CounterMetricFamily(
            "fedge_manager_ingest_messages_total",
            "Messages and uploads ingested since serve started, by verdict.",
            labels=["verdict"],
        )
        for verdict in VERDICTS:
            messages.add_metric([verdict], counters.get(verdict, 0))
        yield messages
        lost = CounterMetricFamily(
            "fedge_manager_edges_lost_by_silence_total",
            "Online edges marked lost because they were silent too long.",
        )
        lost.add_metric([], counters.get("liveness.silent_lost", 0))
        yield lost
        held = GaugeMetricFamily(
            "fedge_manager_ingest_held_messages",
            "Messages held in memory while the store refuses writes.",
        )
        held.add_metric([], self.serve.held())
        yield held
        state = self.serve.store_state()
        store = GaugeMetricFamily(
            "fedge_manager_store_state",
            "The store's state (1 for the one it is in).",
            labels=["state"],
        )
        for name in ("ok", "low", "unwritable"):
            store.add_metric([name], 1.0 if state == name else 0.0)
        yield store
        broker = GaugeMetricFamily(
            "fedge_manager_broker_connected", "1 while serve is connected to the broker."
        )
        broker.add_metric([], 1.0 if self.serve.broker_connected() else 0.0)
        yield broker

    def _certificates(self, readings: FleetReadings) -> Iterator[Metric]:
        not_after: dict[tuple[str, str], float] = {}
        for identity, role, at in [*readings.certificates, *self.files.certificates()]:
            not_after[(identity, role)] = max(at, not_after.get((identity, role), 0.0))
        family = GaugeMetricFamily(
            "fedge_certificate_not_after_timestamp_seconds",
            "When each unrevoked certificate of the fleet expires (newest per identity and role).",
            labels=["identity", "role"],
        )
        for (identity, role), at in sorted(not_after.items()):
            family.add_metric([identity, role], at)
        yield family
        next_update = self.files.crl_next_update()
        if next_update is not None:
            crl = GaugeMetricFamily(
                "fedge_crl_next_update_timestamp_seconds",
                "When the fleet's CRL must be replaced (serve issues it again before).",
            )
            crl.add_metric([], next_update)
            yield crl


def _gauge_by(name: str, help_text: str, label: str, values: Mapping[str, int]) -> Metric:
    family = GaugeMetricFamily(name, help_text, labels=[label])
    for key, n in sorted(values.items()):
        family.add_metric([key], n)
    return family


def _fleet_metrics(readings: FleetReadings) -> Iterator[Metric]:
    yield _gauge_by(
        "fedge_edges", "Enrolled edges by liveness state.", "state", readings.edges_by_state
    )
    config = GaugeMetricFamily(
        "fedge_edges_config",
        "Edges with a desired config: applied the newest (converged) or not yet (pending).",
        labels=["convergence"],
    )
    config.add_metric(["converged"], readings.config_converged)
    config.add_metric(["pending"], readings.config_pending)
    yield config
    yield _gauge_by(
        "fedge_edges_deploy_stage",
        "Edges by the stage of their current deployment.",
        "stage",
        readings.deploy_stages,
    )
    yield _gauge_by(
        "fedge_edges_serving", "Edges by the model they serve.", "model", readings.serving
    )
    info = GaugeMetricFamily(
        "fedge_model_info",
        "Models in the registry (always 1).",
        labels=["model", "version", "run_id"],
    )
    for name, version, run_id in readings.models:
        info.add_metric([name, str(version), run_id], 1)
    yield info
    yield _gauge_by(
        "fedge_rollouts", "Staged rollouts by state.", "state", readings.rollouts_by_state
    )
    alerts = GaugeMetricFamily(
        "fedge_alerts",
        "Monitor alerts by kind and state (open or cleared).",
        labels=["kind", "state"],
    )
    for (kind, is_open), n in sorted(readings.alerts.items()):
        alerts.add_metric([kind, "open" if is_open else "cleared"], n)
    yield alerts
    batches = CounterMetricFamily(
        "fedge_manager_ingest_batches_total", "Record batches stored, by stream.", labels=["stream"]
    )
    duplicates = CounterMetricFamily(
        "fedge_manager_ingest_duplicate_batches_total",
        "Record batches received again and stored once, by stream.",
        labels=["stream"],
    )
    for stream, (stored, duplicate) in sorted(readings.streams.items()):
        batches.add_metric([stream], stored)
        duplicates.add_metric([stream], duplicate)
    yield batches
    yield duplicates
    seen = GaugeMetricFamily(
        "fedge_edge_last_seen_timestamp_seconds",
        "When each edge was last heard from.",
        labels=["edge"],
    )
    for edge, at in readings.last_seen:
        seen.add_metric([edge], at)
    yield seen


def manager_registry(collector: ManagerCollector) -> CollectorRegistry:
    """A registry of its own for one serve (never prometheus_client's global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry

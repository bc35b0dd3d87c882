"""The agent's publisher thread: what leaves the station, every ``flush_interval_s``.

Each pass seals pending records into numbered batches, ticks the gRPC desired poller,
and sends the outbox: over MQTT while connected (a batch is deleted only on the broker's
PUBACK, see :mod:`fedge.edge_agent.uplink.outbox`), or as gRPC uploads while MQTT is
blocked. Every report interval it emits the agent's metrics, and now and then it trims
the store's prediction and label index.
"""

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from fedge.edge_agent.serving import ServingState
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.edge_agent.uplink.outbox import OutboxSender
from fedge.edge_agent.uplink.poller import DesiredPoller

log = logging.getLogger(__name__)

# How often the publisher trims the store's prediction and label index.
PRUNE_EVERY_S = 60.0


class Publisher:
    """The publisher thread; ``connected()`` and the serving state's config and session
    number are read each pass (the agent's MQTT session and applied config change while
    it runs)."""

    def __init__(
        self,
        settings: AgentSettings,
        store: LocalStore,
        counters: Counter[str],
        *,
        outbox: OutboxSender,
        poller: DesiredPoller,
        serving: ServingState,
        connected: Callable[[], bool],
        emit_metrics: Callable[[], None],
        heartbeat: Callable[[], None] = lambda: None,
        telemetry_pace: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.settings = settings
        self.store = store
        self.counters = counters
        self.outbox = outbox
        self.poller = poller
        self._serving = serving
        self._connected = connected
        self._emit_metrics = emit_metrics
        self._heartbeat = heartbeat
        self._telemetry_pace = telemetry_pace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to finish its pass and end (without waiting: see :meth:`join`)."""
        self._stop.set()

    @property
    def alive(self) -> bool:
        """Whether the thread runs (the systemd watchdog pings only while it does)."""
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        last_metrics = time.monotonic()
        last_beat = time.monotonic()
        last_prune = 0.0
        while not self._stop.wait(self.settings.flush_interval_s):
            try:
                config = self._serving.config
                batch_max = 500 if config is None else config.batch_max_records
                session = self._serving.session
                self.store.seal_batches(self.settings.edge, max(session, 0), batch_max)
                self.poller.tick()
                if self._connected() and self.settings.report_via == "mqtt":
                    self.outbox.drain()
                elif self.settings.report_via == "grpc" or self.poller.active:
                    # MQTT blocked for a while: records go the way configs come. A batch
                    # also in flight on MQTT may reach the manager twice; its (edge,
                    # stream, seq) key stores it once.
                    self.outbox.upload()
                beat = self.settings.heartbeat_s
                if beat > 0 and time.monotonic() - last_beat >= beat:
                    last_beat = time.monotonic()
                    self._heartbeat()  # the manager's liveness sweep (issue 27)
                interval = 5.0 if config is None else config.report_interval_s
                # The manager short of space asks for metrics less often (issue 33);
                # the records that matter and the heartbeat keep their pace.
                interval *= self._telemetry_pace()
                if time.monotonic() - last_metrics >= interval:
                    last_metrics = time.monotonic()
                    self._emit_metrics()
                if time.monotonic() - last_prune >= PRUNE_EVERY_S:
                    last_prune = time.monotonic()
                    self.prune_index()
            except Exception:  # the publisher must outlive any single failure
                log.exception("publisher iteration failed")

    def prune_index(self) -> None:
        """The store's prediction and label index keeps ``keep_days`` (at least a day)."""
        keep_s = max(self.settings.keep_days, 1.0) * 86400.0
        self.counters["store.pruned"] += self.store.prune(time.time() - keep_s)

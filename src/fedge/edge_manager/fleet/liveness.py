"""A silent station is lost within seconds, whatever carries its reports (issue 27, item 6;
issue 32, item 2).

MQTT's last will marks an edge lost only when the broker gives up on its connection,
1.5 keepalives (about 45 s) after the link went quiet, and a gRPC-mode station has no
will at all. So every agent repeats its birth as a heartbeat every ``heartbeat_s`` (2.5 s
by default; over MQTT, QoS 0, not retained, or over gRPC), any traffic counts as a sign
of life (``last_seen``), and serve sweeps once a second: an edge stored ``online`` and
silent for ``edge_lost_after_s`` (manager.toml, 7 s by default: two heartbeats missed
and one late) is marked ``lost``. The next heartbeat of the same session marks it
online again; a will or goodbye still says lost or offline at once.

A cut is therefore visible within ``edge_lost_after_s`` + one sweep (at most 8 s by
default) after the station's last heartbeat. The same rule holds for MQTT- and gRPC-mode
stations. Serve's own absence must not read as every station's: nothing is swept until
serve has run ``edge_lost_after_s`` itself. A heartbeat waiting in serve's ingest queue is
no silence either, so silence is judged as of the moment up to which every message serve
received is stored (``stored_through``: when its writer last found the queue empty), not
as of now. Waiting for an empty queue instead starved the sweep at 1,000 stations: 400
heartbeats a second leave it empty only by chance, and cuts showed after 11-12 s
(``fedge bench heartbeat``, BENCHMARKS.md).
"""

import logging
from collections import Counter
from collections.abc import Callable

from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.store import Store, StoreError

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 1.0


def sweep_cutoff(now: float, started: float, lost_after_s: float) -> float | None:
    """The ``last_seen`` under which an online edge is lost as of ``now`` (the moment
    serve has stored everything it received before); None: no sweep now (the rule is
    off, or serve itself had not been up ``lost_after_s`` by then)."""
    if lost_after_s <= 0 or now - started < lost_after_s:
        return None
    return now - lost_after_s


class SilenceSweep:
    """Runs the rule on serve's writer thread, about once a second."""

    def __init__(
        self,
        lost_after_s: float,
        counters: Counter[str],
        *,
        started: float,
        stored_through: Callable[[], float | None],
    ) -> None:
        """``stored_through``: the wall-clock moment before which every message serve
        received is stored; None while some are held (a store outage): nothing judged."""
        self.lost_after_s = lost_after_s
        self.counters = counters
        self.started = started
        self._stored_through = stored_through
        self._due = 0.0

    def tick(self, store: Store, now: float) -> list[str]:
        if now < self._due:
            return []
        self._due = now + SWEEP_EVERY_S
        through = self._stored_through()
        if through is None:
            return []
        cutoff = sweep_cutoff(min(now, through), self.started, self.lost_after_s)
        if cutoff is None:
            return []
        try:
            lost = edge_store.mark_silent_lost(store, cutoff)
        except StoreError as exc:  # the store's refusal is said by ingest; tried next tick
            log.debug("liveness sweep not written: %s", exc)
            return []
        if lost:
            self.counters["liveness.silent_lost"] += len(lost)
            shown = ", ".join(lost[:10]) + (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
            log.warning("no sign of life for %.0f s: marked lost %s", self.lost_after_s, shown)
        return lost

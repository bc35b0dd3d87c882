"""Asking the fleet to send telemetry less often while the store is short of space.

Issue 33: under the headroom (home/space.py) the manager prunes early and asks every
station for its metric records ``SLOW_FACTOR`` times less often, through a signed
``pace`` desired document per edge (protocols/pace.py); once space is back it asks for
the normal pace again. Telemetry is what a healthy fleet sends most of and what loses
least by waiting; predictions, labels, statuses and heartbeats keep their pace, so
nothing an operator or a rollout decides on arrives later.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.home.space import DiskSpace, describe_space
from fedge.edge_manager.store import unwritable
from fedge.protocols import codec, topics
from fedge.protocols.pace import TelemetryPace

if TYPE_CHECKING:
    from fedge.edge_manager.fleet.operations import Fleet

log = logging.getLogger(__name__)

PACE = topics.Down.PACE.value
# 5 s report interval -> 30 s: a sixth of the telemetry rows, while counters an operator
# watches still move twice a minute.
SLOW_FACTOR = 6.0


def wanted_factor(low_space: bool) -> float:
    return SLOW_FACTOR if low_space else 1.0


def factor_at(fleet: Fleet, edge: str) -> float:
    """The factor ``edge`` was last asked for (1: never asked)."""
    latest = desired_store.latest_document(fleet.store, edge, PACE)
    return 1.0 if latest is None else codec.decode(latest.encode(), TelemetryPace).factor


def push_pace(fleet: Fleet, factor: float, reason: str, now: float) -> int:
    """Ask every edge not already asked for ``factor``, in one transaction; how many."""
    asked = 0
    with fleet.store.transaction():
        for edge in fleet.edges():
            if factor_at(fleet, edge) == factor:
                continue
            version = (desired_store.latest_version(fleet.store, edge, PACE) or 0) + 1
            document = TelemetryPace(fleet.fleet, edge, version, factor, reason, now)
            fleet.write_desired(edge, PACE, version, codec.encode(document), now)
            # The newest pace says everything: older ones are never needed.
            desired_store.delete_older(fleet.store, edge, PACE, version)
            asked += 1
    return asked


class Pacer:
    """The serve loop's side: ask the fleet for telemetry less often while space is low,
    and for the normal pace once it is not; a write the store refuses is tried again a
    second later (the serve loop's one writer thread calls :meth:`tick`)."""

    RETRY_S = 1.0
    # While slowed, look again this often for stations enrolled since (push_pace asks
    # only those not already at the pace).
    RECHECK_S = 10.0

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self.asked: float | None = None  # the factor last asked of the fleet this run
        self._retry_at = 0.0  # after a write the store refused
        self._recheck_at = 0.0  # while slowed: the next look for newly enrolled stations

    def tick(self, fleet: Fleet, low_space: bool, measured: DiskSpace | None, now: float) -> None:
        want = wanted_factor(low_space)
        if now < self._retry_at:
            return
        if want == self.asked and (want == 1.0 or now < self._recheck_at):
            return
        reason = ""
        if want > 1.0 and measured is not None:
            reason = f"the manager's store is short of space ({describe_space(measured)})"
        try:
            asked = push_pace(fleet, want, reason, now)
        except Exception as exc:
            if not unwritable(exc):
                raise
            self.counters["store.pace_failed"] += 1
            log.warning("could not ask the fleet for a telemetry pace of %gx: %s", want, exc)
            self._retry_at = now + self.RETRY_S
            return
        self.asked = want
        self._recheck_at = now + self.RECHECK_S
        if not asked:
            return
        self.counters["store.pace_changes"] += 1
        if want > 1.0:
            log.warning(
                "asked %d station(s) for telemetry %gx less often until space returns "
                "(predictions and labels keep their pace)",
                asked,
                want,
            )
        else:
            log.info("asked %d station(s) for telemetry at the normal pace again", asked)

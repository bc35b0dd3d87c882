"""The telemetry pace the manager asks for (issue 33), arriving at the station.

Signed and versioned like a config: a forged, foreign or replayed document is refused
and counted, and changes nothing. The factor applies to the metric records the
publisher sends every report interval, nothing else; it survives a restart (the
store keeps it) so a station that restarts while the manager is short of space does
not flood it again.
"""

import logging
from collections import Counter
from dataclasses import dataclass

from fedge.edge_agent.store import LocalStore
from fedge.protocols.errors import ProtocolError
from fedge.protocols.pace import TelemetryPace
from fedge.protocols.signing import TrustedKeys, open_signed

log = logging.getLogger(__name__)

_VERSION, _FACTOR, _REASON = "pace_version", "telemetry_pace", "telemetry_pace_reason"


@dataclass(frozen=True)
class Pace:
    """The pace in force at the station."""

    version: int
    factor: float
    reason: str


def current(store: LocalStore) -> Pace:
    return Pace(
        int(store.get(_VERSION) or 0),
        float(store.get(_FACTOR) or 1.0),
        store.get(_REASON) or "",
    )


def apply_pace(
    envelope: bytes,
    *,
    fleet: str,
    edge: str,
    keys: TrustedKeys,
    store: LocalStore,
    counters: Counter[str],
) -> Pace | None:
    """Check the signed pace document and keep it; the pace now in force, or None when
    the document was refused or no newer than the one applied."""
    try:
        document = open_signed(envelope, TelemetryPace, keys)
        if document.edge != edge or document.fleet != fleet:
            raise ProtocolError(f"pace is for {document.fleet}/{document.edge}")
    except ProtocolError as exc:
        counters[f"pace.rejected.{exc.reason}"] += 1
        log.error("telemetry pace rejected (%s): %s", exc.reason, exc)
        return None
    if document.version <= current(store).version:
        counters["pace.stale"] += 1
        return None
    # The factor before the version: a crash in between applies the document again.
    store.put(_FACTOR, repr(document.factor))
    store.put(_REASON, document.reason)
    store.put(_VERSION, str(document.version))
    counters["pace.applied"] += 1
    if document.slowed:
        log.warning(
            "the manager asks for telemetry %gx less often: %s", document.factor, document.reason
        )
    else:
        log.info("telemetry back to its normal pace (manager document v%d)", document.version)
    return Pace(document.version, document.factor, document.reason)

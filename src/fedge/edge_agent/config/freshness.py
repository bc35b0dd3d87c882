"""How fresh the station's signed desired state is: the freeze-attack check (issue 24).

The manager re-signs the desired config and the trust chain before they expire
(protocols/freshness.py). Each time one arrives verified with a later expiry than the
station held, this notes when (the station's clock) in the agent's store; a replay of an
old document extends nothing. Once nothing has been refreshed for
``desired_stale_after_days`` (or what the station holds has expired) the desired state
is *stale*: someone may be withholding the manager's documents (or the manager stopped).
The station keeps running with what it applied, logs a warning, and says so in its trust
report and status.
"""

import json
import logging
import threading
import time
from collections.abc import Callable

from fedge.edge_agent.store import LocalStore
from fedge.protocols.freshness import Staleness, staleness, when

log = logging.getLogger(__name__)
_KEY = "desired_freshness"  # {kind: [expires_at, refreshed_at]}


class DesiredFreshness:
    def __init__(
        self,
        store: LocalStore,
        stale_after_s: float,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, float]] = {
            str(kind): (float(pair[0]), float(pair[1]))
            for kind, pair in json.loads(store.get(_KEY) or "{}").items()
        }
        self._stale = False

    def note(self, kind: str, expires_at: float | None) -> bool:
        """A verified ``kind`` document expiring at ``expires_at`` arrived; True if it
        refreshed what the station held (a later expiry)."""
        if expires_at is None:
            return False
        with self._lock:
            held = self._seen.get(kind)
            if held is not None and expires_at <= held[0]:
                return False
            self._seen[kind] = (expires_at, self.clock())
            self.store.put(_KEY, json.dumps({k: list(v) for k, v in sorted(self._seen.items())}))
        return True

    def staleness(self) -> Staleness:
        """The least fresh of the kinds the station holds with an expiry."""
        now = self.clock()
        with self._lock:
            seen = list(self._seen.values())
        if not seen:
            return staleness(None, None, now, self.stale_after_s)
        expires_at = min(e for e, _ in seen)
        refreshed_at = min(r for _, r in seen)
        return staleness(refreshed_at, expires_at, now, self.stale_after_s)

    def changed(self) -> Staleness | None:
        """The staleness when it flipped since the last call (logged), else None."""
        now_stale = self.staleness()
        if now_stale.stale == self._stale:
            return None
        self._stale = now_stale.stale
        if now_stale.stale:
            log.warning(
                "desired state %s: no signed refresh from the manager for more than %.1f "
                "days; running with what was applied. Check that `fedge manager serve` runs "
                "and that this station reaches the broker (someone may be withholding it)",
                now_stale.describe(),
                self.stale_after_s / 86400.0,
            )
        else:
            refreshed = now_stale.refreshed_at
            log.warning("desired state fresh again (refreshed %s)", when(refreshed or 0.0))
        return now_stale

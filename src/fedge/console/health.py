"""Whether what the console shows is live (issue 30, item 1): the badge and the banner.

"live" means fresh station data -- ``manager serve`` running and connected to its broker,
and at least one station heard from within its stale window -- not merely that this
browser's connection to the console is open. Otherwise a banner says plainly what is
wrong and how old the figures are.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedge.console.freshness import STALE, ago, stale_after_s
from fedge.console.views import FleetRow
from fedge.edge_manager.home.run_dir import Role, read_serve_state, running, serve_notice

SERVE_CONSEQUENCE = (
    "station reports are not being stored, so what the console shows is as of the last report"
)
NAMED = 5  # stale stations named in the banner; the rest are counted


@dataclass(frozen=True)
class Health:
    live: bool
    banner: str  # '' when all is well

    def to_json(self) -> dict[str, object]:
        return {"live": self.live, "banner": self.banner}


def notice(root: Path) -> str | None:
    """What is wrong with ``manager serve`` on the home at ``root`` (not running, not
    connected to the broker, or its store unwritable: issue 33), None when all is well."""
    found = serve_notice(root, SERVE_CONSEQUENCE)
    if found is not None:
        return found
    state, serving = read_serve_state(root), running(root, Role.SERVE)
    current = state is not None and serving is not None and state.pid == serving.pid
    if state is not None and current and state.store == "unwritable":
        since = ""
        if state.store_since is not None:
            since = f" since {ago(time.time() - state.store_since)}"
        return (
            f"the manager's store is unwritable{since} ({state.store_detail}); "
            f"{state.held} message(s) wait in memory, and station reports are stored once "
            "it can be written again (`fedge manager doctor` says more)"
        )
    return None


def fleet_health(
    serve: str | None, rows: Sequence[FleetRow], newest_seen: float | None, now: float | None = None
) -> Health:
    """The fleet's health from ``serve``'s notice and every edge's row (states as shown)."""
    now = time.time() if now is None else now
    stale = [row.edge for row in rows if row.state == STALE]
    online = sum(row.state == "online" for row in rows)
    heard = "never" if newest_seen is None else ago(now - newest_seen)
    parts = []
    if serve is not None:
        parts.append(f"{serve}.")
    if stale:
        names = ", ".join(stale[:NAMED]) + (
            f" and {len(stale) - NAMED} more" if len(stale) > NAMED else ""
        )
        parts.append(
            f"{len(stale)} station{'s' if len(stale) != 1 else ''} stale (online when last "
            f"heard, silent for over {stale_after_s():.0f} s): {names}."
        )
    if online == 0 and rows:
        parts.append(f"No station is reporting; the last report arrived {heard}.")
    return Health(live=serve is None and online > 0, banner=" ".join(parts))

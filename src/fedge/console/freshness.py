"""How fresh what the console shows is: an edge's state aged against now, and times said
plainly (issue 30, item 1).

The manager stores the state an edge last *reported* (its birth, its last will). When the
agent, the broker or ``manager serve`` stops, nothing reports the change: the store keeps
saying "online". So the console ages that state itself. An agent sends telemetry every
``report_interval_s`` of the config in force (5 s by default, uplink/publisher.py); an
edge stored as online that has not been heard for :data:`STALE_BEATS` of those intervals
plus :data:`GRACE_S` is shown as ``stale`` -- with the default interval, after 20 s.
"""

import datetime
from dataclasses import dataclass

STALE_BEATS = 3  # missed heartbeats (telemetry reports) before an online edge is stale
GRACE_S = 5.0  # slack for a batch in flight and the console's own poll
DEFAULT_REPORT_INTERVAL_S = 5.0  # EdgeConfig's default, what an edge without a config uses
STALE = "stale"


def stale_after_s(report_interval_s: float = DEFAULT_REPORT_INTERVAL_S) -> float:
    """Seconds without a report after which an online edge is shown stale."""
    return STALE_BEATS * report_interval_s + GRACE_S


def shown_state(
    state: str,
    last_seen: float | None,
    now: float,
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S,
) -> str:
    """The state to show: the stored one, except an "online" edge not heard from for
    :func:`stale_after_s` is ``stale`` (its agent, the broker or ``manager serve`` may be
    gone; nothing is left to say so)."""
    if state != "online":
        return state
    if last_seen is None or now - last_seen > stale_after_s(report_interval_s):
        return STALE
    return state


def ago(seconds: float) -> str:
    """'just now', '12 s ago', '13 min ago', '2 h ago', '3 days ago'."""
    if seconds < 2:
        return "just now"
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def when(ts: float | None) -> str:
    """Local date and time to the second with the zone's name, or '-'."""
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(float(ts)).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


@dataclass(frozen=True)
class Pending:
    """A desired config the edge has not applied: which, since when, and what is known."""

    version: int
    created_at: float
    published_at: float | None  # None: ``manager serve`` has not published it yet
    rejected: str = ""  # the edge's reason, when it refused this version


def sync_text(
    in_sync: bool,
    state: str,
    last_seen: float | None,
    pending: Pending | None,
    revoked: bool = False,
) -> str:
    """The sync cell: 'in sync', or why the newest desired config is not in force yet."""
    if revoked:
        return "revoked: no config is sent to it"
    if in_sync or pending is None:
        return "in sync"
    since = f"pending v{pending.version} since {when(pending.created_at)}"
    if pending.rejected:
        return f"rejected v{pending.version}: {pending.rejected}"
    if pending.published_at is None:
        return f"{since}: not published yet (is `fedge manager serve` running?)"
    if state == "never-seen":
        return f"{since}: the station has never connected"
    if state != "online":
        return f"{since}: the station is {state}, last seen {when(last_seen)}"
    return f"{since}: sent, waiting for the station's report"


def pending(
    version: int,
    created_at: float,
    published_at: float | None,
    config_status: str,
    config_reason: str,
) -> Pending:
    """A pending config from the edge's last config report (``config_status`` is
    'applied:<offered>' or 'rejected:<offered>'): rejected when it refused this version."""
    status, _, offered = config_status.partition(":")
    refused = status == "rejected" and offered == str(version)
    return Pending(version, created_at, published_at, config_reason if refused else "")

"""When the store cannot take ingest's transaction (issue 33): hold, retry, say it once.

A full disk (or a read-only or failing one) makes the serve loop's transaction fail. The
messages in it were never acknowledged to the broker, and they must not be: a message
is acknowledged only after it is stored. What happens to them then is decided here.

**Held in memory and retried, not handed back to the broker.** The serve loop keeps each
message of a failed transaction, unacknowledged and in arrival order, and tries the
transaction again after a bounded back-off (:data:`RETRY_FIRST_S` doubling up to
:data:`RETRY_MAX_S`); messages that arrive meanwhile wait behind them. The other way --
dropping the MQTT session so the broker redelivers -- was rejected:

- Mosquitto resends an unacknowledged QoS 1 message only on a new connection, and keeps
  at most its in-flight window of them per client (``max_inflight_messages``, 200 in the
  broker fedge configures, or the client's MQTT 5 Receive Maximum); every reconnect
  during the outage would resend that window into the same full disk, and the rest would
  queue behind it in the broker's memory.
- What sits in the broker's memory is lost when the broker restarts while its own save
  file cannot be written (it is on the same disk by default).

So the manager asks the broker for a large window (:data:`RECEIVE_MAXIMUM`, MQTT's
largest Receive Maximum): the broker hands over what the stations publish as it comes,
the manager holds it (at most that many messages: the broker sends no more until some
are acknowledged), and a broker restarted during the outage cannot take it away.

**Acknowledged on the connection that delivered it.** After a reconnect a packet id of
the old connection may name another message; a message held across one is stored but
not acknowledged. The broker then either kept the session and sent it again (that copy
is stored as a duplicate -- the (edge, stream, seq) batch key -- and acknowledged), or
lost the session and has nothing to acknowledge.

**The gap closes by itself.** Once space returns, the next try comes at most
:data:`RETRY_MAX_S` later and stores what waited, oldest first; the broker then sends
what it queued beyond the window. Nothing restarts. The whole fleet waits for one full
disk no longer than the outage plus :data:`RETRY_MAX_S` and the time to store the
backlog (the serve loop stores tens of thousands of records a second).

**Said once.** One line when the store becomes unwritable (what failed, where, how much
space is free) and one when it is written again (how long, how many messages waited);
the retries in between are counted, not logged.
"""

from dataclasses import dataclass, replace

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home.space import DiskSpace, describe_space

RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
# MQTT 5's largest Receive Maximum (a two-byte integer): how many unacknowledged QoS 1
# messages the broker may have out to the manager, so also how many it may hold.
RECEIVE_MAXIMUM = 65535


class StoreUnwritableError(ManagerError):
    """The store cannot take a write now; what was sent is not stored (send it again)."""


@dataclass(frozen=True)
class Outage:
    """The store has refused ingest's transactions since ``since``."""

    since: float
    error: str  # the first failure, as the driver said it
    failures: int  # transactions tried and failed so far
    retry_at: float  # when the held messages are tried again


def backoff_s(failures: int) -> float:
    """The wait after the ``failures``-th failed try: doubling from the first, capped."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** max(0, failures - 1))


def failed(outage: Outage | None, now: float, error: str) -> Outage:
    """The outage after one more failed transaction (a new one if there was none)."""
    if outage is None:
        return Outage(since=now, error=error, failures=1, retry_at=now + backoff_s(1))
    failures = outage.failures + 1
    return replace(outage, failures=failures, retry_at=now + backoff_s(failures))


def retry_due(outage: Outage | None, now: float) -> bool:
    """Whether held messages may be tried now (always, when there is no outage)."""
    return outage is None or now >= outage.retry_at


def unwritable_line(error: str, where: str, space: DiskSpace | None) -> str:
    """The one line said when the store stops taking writes."""
    free = "free space unknown" if space is None else describe_space(space)
    return (
        f"store unwritable: {error} ({where}; {free}); ingest holds messages "
        f"unacknowledged and tries again every {RETRY_MAX_S:g} s at most; free space "
        "on that file system (or fix what the error names) and it carries on by itself"
    )


def recovered_line(outage: Outage, now: float, waited: int) -> str:
    """The one line said when the store takes writes again."""
    return (
        f"store writable again after {now - outage.since:.1f} s: {waited} message(s) "
        f"waited and are being stored ({outage.failures} tries failed)"
    )

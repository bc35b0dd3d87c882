"""What an MQTT connection is doing, and which of its changes an operator is told about.

Pure: :func:`advance` folds one connection event into a :class:`LinkState` and says what
to log, if anything. Every change of state is logged once (connected, lost, reconnected
and after how long); a broker that stays unreachable is reported on the first failed
attempt and then every ``REMIND_EVERY`` attempts (about every ten minutes at paho's 30 s
backoff), so a long outage neither floods the log nor goes quiet (issue 15).
"""

import enum
import logging
from dataclasses import dataclass, replace

REMIND_EVERY = 20


class LinkEvent(enum.Enum):
    CONNECTED = "connected"
    REFUSED = "refused"  # the broker answered and refused (credentials, ACL, ...)
    UNREACHABLE = "unreachable"  # no broker answered (refused TCP, timeout, DNS)
    DROPPED = "dropped"  # a live connection ended without us asking
    STOPPED = "stopped"  # we disconnected


@dataclass(frozen=True)
class LinkState:
    connected: bool = False
    ever_connected: bool = False
    failures: int = 0  # failed attempts since the link was last up
    down_since: float | None = None  # when the link was last lost (or first tried)
    last_error: str = ""


@dataclass(frozen=True)
class LinkNote:
    level: int
    message: str


def advance(
    state: LinkState, event: LinkEvent, *, at: float, detail: str = ""
) -> tuple[LinkState, LinkNote | None]:
    """The state after ``event`` at time ``at``, and the line to log (None: nothing new)."""
    if event is LinkEvent.CONNECTED:
        if not state.ever_connected:
            note = LinkNote(logging.INFO, "connected")
        else:
            down_s = 0.0 if state.down_since is None else max(0.0, at - state.down_since)
            note = LinkNote(
                logging.INFO,
                f"reconnected after {down_s:.0f} s ({state.failures} failed attempts)",
            )
        return LinkState(connected=True, ever_connected=True), note
    if event is LinkEvent.STOPPED:
        return replace(state, connected=False, down_since=at), LinkNote(
            logging.INFO, "disconnected (stopping)"
        )
    if event is LinkEvent.DROPPED:
        if not state.connected:
            return state, None  # the end of a refused attempt, already reported
        return (
            replace(state, connected=False, failures=0, down_since=at, last_error=detail),
            LinkNote(
                logging.WARNING, f"connection lost ({detail or 'no reason given'}); reconnecting"
            ),
        )
    failures = state.failures + 1
    down_since = at if state.down_since is None else state.down_since
    next_state = replace(
        state, connected=False, failures=failures, down_since=down_since, last_error=detail
    )
    if failures != 1 and failures % REMIND_EVERY != 0:
        return next_state, None
    refused = event is LinkEvent.REFUSED
    # A refusal (wrong password, revoked edge) needs a person; an outage may pass.
    level = logging.ERROR if refused else logging.WARNING
    what = "refused the connection" if refused else "is not reachable"
    why = f" ({detail})" if detail else ""
    if failures == 1:
        return next_state, LinkNote(level, f"broker {what}{why}; retrying")
    return next_state, LinkNote(
        level,
        f"broker still {what} after {failures} attempts over {at - down_since:.0f} s"
        f"{why}; retrying",
    )

"""Expiry of signed desired documents, and a station's view of how fresh they are.

TUF puts an expiry on all of its metadata so that a client can tell a frozen repository
(an attacker replaying old, validly signed documents, or withholding new ones) from a
quiet one (Samuel et al., CCS 2010, "freeze attack"). fedge does the same for the
documents a station acts on: the desired config (``EdgeConfig.expires_at``) and the
trust chain (``TrustChain.expires_at``). The manager signs them with an expiry
:data:`LIFETIME_S` ahead and re-signs (refreshes) them, same version, once less than
half of that is left (:func:`needs_refresh`); a station refuses a document that arrives
expired (:func:`check_not_expired`) and reports its desired state stale once nothing
has refreshed it for ``stale_after_s`` (:func:`staleness`).

An applied config that expires stays in force: a station does not stop inspecting parts
because its manager is unreachable, it says so.
"""

import datetime
from dataclasses import dataclass

from fedge.protocols.errors import ExpiredError

DAY_S = 86400.0
LIFETIME_S = 14 * DAY_S  # a signed config or trust chain is valid this long
REFRESH_INTERVAL_S = LIFETIME_S / 2  # re-signed once less than half is left
STALE_AFTER_S = 2 * REFRESH_INTERVAL_S  # a station's default: two missed refreshes


def expiry(now: float, lifetime_s: float = LIFETIME_S) -> float:
    return now + lifetime_s


def needs_refresh(expires_at: float | None, now: float, lifetime_s: float = LIFETIME_S) -> bool:
    """Whether a document the manager still sends is due to be signed again: it has no
    expiry (written by a version of fedge that did not stamp one) or less than half its
    lifetime is left."""
    return expires_at is None or expires_at - now < lifetime_s / 2


def when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat(timespec="seconds")


def check_not_expired(what: str, expires_at: float | None, now: float) -> None:
    """Raise :class:`ExpiredError` if ``expires_at`` has passed."""
    if expires_at is not None and expires_at <= now:
        raise ExpiredError(
            f"{what} expired at {when(expires_at)} (now {when(now)}): a replayed old "
            "document, or a manager that has not refreshed it; check that `fedge manager "
            "serve` runs and that this station's clock is right"
        )


@dataclass(frozen=True)
class Staleness:
    """Whether a station's desired state is stale, and since when it was last refreshed."""

    stale: bool
    refreshed_at: float | None  # when (station clock) a document last extended its expiry
    expires_at: float | None  # the latest expiry it holds (None: no expiring document yet)
    expired: bool

    def describe(self) -> str:
        if not self.stale:
            return "fresh"
        since = "never" if self.refreshed_at is None else when(self.refreshed_at)
        text = f"stale since {since}"
        if self.expired and self.expires_at is not None:
            text += f" (expired at {when(self.expires_at)})"
        return text


def staleness(
    refreshed_at: float | None, expires_at: float | None, now: float, stale_after_s: float
) -> Staleness:
    """A station's desired state is stale once nothing refreshed it for ``stale_after_s``
    or what it holds has expired. A station that never got an expiring document (a fleet
    without a manager that refreshes, or not configured yet) is not stale."""
    if refreshed_at is None:
        return Staleness(False, None, expires_at, False)
    expired = expires_at is not None and expires_at <= now
    stale = expired or now - refreshed_at > stale_after_s
    return Staleness(stale, refreshed_at, expires_at, expired)

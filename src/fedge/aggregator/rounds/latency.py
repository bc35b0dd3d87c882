"""What we know of each party's latency: TiFL's profiling, online and smoothed.

Chai et al., "TiFL: A Tier-based Federated Learning System", HPDC'20, §3.2-3.3. The paper
profiles offline (``sync_rounds`` rounds of everyone, summing latencies, a time-out adding
``T_max``) and mentions an online variant (§3.3). We keep an exponentially weighted mean
per party, updated from every reply (:func:`observe`); a time-out counts as an observation
of ``T_max`` (:func:`observe_timeout`), so a party that only ever timed out has a mean of
exactly ``T_max`` and ``tiers.form_tiers(..., dropout_threshold_s=T_max)`` drops it -- the
mean form of the paper's ``L_i >= sync_rounds * T_max``.

Every strategy keeps these profiles (deadlines are derived from them too); the tiers in
:mod:`fedge.aggregator.tiers.groups` are cut from :func:`mean_latencies`.
"""

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from fedge.aggregator.rounds.deadline import Settlement


@dataclass(frozen=True)
class LatencyProfile:
    """What we know of one party's latency (seconds from push to reply)."""

    mean_s: float  # exponentially weighted mean of every observation
    count: int  # observations, time-outs included
    last_s: float
    timeouts: int = 0

    def __post_init__(self) -> None:
        for name in ("mean_s", "last_s"):
            _check_seconds(getattr(self, name), name)
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if not 0 <= self.timeouts <= self.count:
            raise ValueError(f"timeouts must be in [0, count={self.count}], got {self.timeouts}")


def observe(
    profile: LatencyProfile | None, latency_s: float, *, alpha: float = 0.3
) -> LatencyProfile:
    """Fold one reply's latency into a party's profile (TiFL §3.3, online profiling).

    EWMA with weight ``alpha`` on the new observation; the first observation is the mean.
    """
    _check_seconds(latency_s, "latency_s")
    return _update(profile, latency_s, alpha, timed_out=False)


def observe_timeout(
    profile: LatencyProfile | None, t_max_s: float, *, alpha: float = 0.3
) -> LatencyProfile:
    """A party that did not reply within ``T_max`` is charged ``T_max`` (TiFL §3.2)."""
    _check_seconds(t_max_s, "t_max_s")
    return _update(profile, t_max_s, alpha, timed_out=True)


def mean_latencies(profiles: Mapping[int, LatencyProfile]) -> dict[int, float]:
    """The per-party latencies :func:`form_tiers` sorts: each profile's mean."""
    return {party: profile.mean_s for party, profile in profiles.items()}


def observe_round(
    profiles: MutableMapping[int, LatencyProfile],
    arrivals: Mapping[int, float | None],
    settlement: Settlement,
    deadline_s: float | None,
) -> None:
    """Update ``profiles`` from a settled round (TiFL §3.2-3.3).

    Every reply observes its latency; a party that failed, or is late and never replied,
    is charged ``T_max``: the round's deadline, else the round's length.
    """
    for node, seconds in arrivals.items():
        if seconds is not None:
            profiles[node] = observe(profiles.get(node), seconds)
    t_max = deadline_s if deadline_s is not None else settlement.round_time_s
    for node in settlement.failed:
        profiles[node] = observe_timeout(profiles.get(node), t_max)
    for node in settlement.late:
        if arrivals.get(node) is None:
            profiles[node] = observe_timeout(profiles.get(node), t_max)


def _update(
    profile: LatencyProfile | None, latency_s: float, alpha: float, *, timed_out: bool
) -> LatencyProfile:
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if profile is None:
        return LatencyProfile(latency_s, 1, latency_s, int(timed_out))
    # mean + alpha * (x - mean) keeps the mean exactly at x when x repeats (a party that
    # always times out stays at T_max, so the dropout test ">= T_max" holds); the clamp
    # keeps rounding from stepping outside [mean, x].
    low, high = sorted((profile.mean_s, latency_s))
    mean = min(max(profile.mean_s + alpha * (latency_s - profile.mean_s), low), high)
    return LatencyProfile(
        mean_s=mean,
        count=profile.count + 1,
        last_s=latency_s,
        timeouts=profile.timeouts + int(timed_out),
    )


def _check_seconds(value: float, name: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")

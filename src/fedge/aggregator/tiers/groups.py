"""TiFL's tiers: parties grouped by latency, as pure functions over frozen dataclasses.

Chai et al., "TiFL: A Tier-based Federated Learning System", HPDC'20. A round lasts as long
as its slowest party (Eq. 1), and with random selection some party of the slowest group is
almost always picked (Eq. 2-4). TiFL therefore groups parties of similar latency into
tiers, draws one tier per round (:mod:`fedge.aggregator.tiers.selection`) and selects the
round's parties inside it.

Deliberate divergences from the paper:

* **Online, smoothed profiling.** The paper profiles offline (``sync_rounds`` rounds of
  everyone, summing latencies, a time-out adding ``T_max``) and mentions an online variant
  (§3.3). We keep an exponentially weighted mean per party, updated from every reply
  (:mod:`fedge.aggregator.rounds.latency`); a party that only ever timed out has a mean of exactly
  ``T_max`` and ``form_tiers(..., dropout_threshold_s=T_max)`` drops it -- the mean form of
  the paper's ``L_i >= sync_rounds * T_max``.
* **Balanced tier sizes.** Public implementations cut the sorted parties into chunks of
  ``ceil(N/m)`` (fltk), which can yield fewer than ``m`` tiers (5 parties, 4 tiers: 2+2+1).
  :func:`form_tiers` always returns ``min(m, N)`` non-empty tiers whose sizes are
  ``ceil(N/m)`` or ``floor(N/m)``, the larger ones first (the fastest tiers).
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Tiers:
    """Parties grouped by latency, fastest tier first (index 0)."""

    members: tuple[tuple[int, ...], ...]
    dropouts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for index, tier in enumerate(self.members):
            if not tier:
                raise ValueError(f"tier {index} is empty")
            for party in tier:
                if party in seen:
                    raise ValueError(f"party {party} appears in more than one tier")
                seen.add(party)
        for party in self.dropouts:
            if party in seen:
                raise ValueError(f"party {party} is both a dropout and a tier member")
            seen.add(party)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Tiers":
        """Inverse of ``dataclasses.asdict`` after a JSON round trip (lists -> tuples)."""
        return cls(
            members=tuple(tuple(int(p) for p in tier) for tier in data["members"]),
            dropouts=tuple(int(p) for p in data.get("dropouts", ())),
        )

    @property
    def n_tiers(self) -> int:
        return len(self.members)

    def tier_of(self, party: int) -> int | None:
        """The tier a party belongs to (None for dropouts and unknown parties)."""
        for index, tier in enumerate(self.members):
            if party in tier:
                return index
        return None

    def latency_p90(self, tier: int, latencies: Mapping[int, float]) -> float:
        """90th percentile (linear interpolation) of the tier's member latencies."""
        return float(np.percentile(self._latencies(tier, latencies), 90))

    def latency_max(self, tier: int, latencies: Mapping[int, float]) -> float:
        """The tier's slowest member: ``max(L_tier_i)`` in TiFL's Eq. 5."""
        return max(self._latencies(tier, latencies))

    def _latencies(self, tier: int, latencies: Mapping[int, float]) -> list[float]:
        if not 0 <= tier < len(self.members):
            raise ValueError(f"tier must be in [0, {len(self.members)}), got {tier}")
        missing = [p for p in self.members[tier] if p not in latencies]
        if missing:
            raise ValueError(f"no latency for parties {missing} of tier {tier}")
        return [latencies[p] for p in self.members[tier]]


def form_tiers(
    latencies: Mapping[int, float],
    n_tiers: int,
    *,
    dropout_threshold_s: float | None = None,
    min_size: int = 1,
) -> Tiers:
    """Sort parties by latency and cut them into ``n_tiers`` tiers, fastest first (TiFL §3.2).

    Parties whose latency is at or above ``dropout_threshold_s`` are excluded and listed in
    ``dropouts``. Ties are broken by party id, so the result is deterministic. Sizes are
    ``ceil(N/n_tiers)`` for the first ``N % n_tiers`` tiers and ``floor`` for the rest;
    with fewer parties than tiers, each party is its own tier (``min(n_tiers, N)`` tiers).
    ``min_size``: every tier holds at least that many parties, so there are at most
    ``N // min_size`` tiers (SecAgg+ asks 3: a tier of 2 would reveal each one's update to
    the other); fewer parties than that make one tier of them all.
    """
    if n_tiers < 1:
        raise ValueError(f"n_tiers must be >= 1, got {n_tiers}")
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    for party, latency in latencies.items():
        if math.isnan(latency) or latency < 0:
            raise ValueError(f"latency of party {party} must be >= 0, got {latency}")
    ranked = sorted(latencies, key=lambda party: (latencies[party], party))
    if dropout_threshold_s is None:
        kept, dropouts = ranked, []
    else:
        kept = [p for p in ranked if latencies[p] < dropout_threshold_s]
        dropouts = sorted(p for p in ranked if latencies[p] >= dropout_threshold_s)
    count = min(n_tiers, len(kept), max(1, len(kept) // min_size))
    members: list[tuple[int, ...]] = []
    start = 0
    for index in range(count):
        size = len(kept) // count + (1 if index < len(kept) % count else 0)
        members.append(tuple(kept[start : start + size]))
        start += size
    return Tiers(tuple(members), tuple(dropouts))

"""Which architecture each party trains and serves: its TiFL tier's (pure functions).

A distilling job (FedDF across tiers, :mod:`fedge.aggregator.strategies.feddf`) gives each
tier an architecture, fastest tier first (``tier_archs``), so the slow tiers train, and
are deployed, a small model (KnowledgeNet's compact edge student, TiFL's tiers). The same
rule decides who trains what in a round and which model a fleet station is sent once the
job has ended (:func:`stations_by_architecture`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from fedge.aggregator.errors import AggregatorError
from fedge.aggregator.tiers.groups import Tiers


class TierArchitectureError(AggregatorError):
    """Tier architectures that cannot be assigned: none given, or a tier left empty."""


def tier_architecture(tier: int, formed: int, tier_archs: Sequence[str]) -> str:
    """The architecture of tier ``tier`` of ``formed`` tiers.

    A (re-)tiering may form fewer tiers than configured (fewer parties, dropouts): tiers
    then map proportionally, so the fastest keeps the first architecture and the slowest
    moves towards the last."""
    if not tier_archs:
        raise TierArchitectureError("tier_archs names no architecture")
    if not 0 <= tier < formed:
        raise TierArchitectureError(f"tier {tier} is not one of {formed} tiers")
    return tier_archs[tier * len(tier_archs) // formed]


def architecture_of(
    party: int, tiers: Tiers | None, tier_archs: Sequence[str], largest: str
) -> str:
    """What ``party`` trains: its tier's architecture. Before tiers exist (TiFL's profiling
    rounds) everyone gets ``largest``; a dropout (the slowest parties) the last tier's; a
    party the tiers do not know (joined since), ``largest``."""
    if tiers is None:
        return largest
    tier = tiers.tier_of(party)
    if tier is None:
        return tier_archs[-1] if party in tiers.dropouts else largest
    return tier_architecture(tier, tiers.n_tiers, tier_archs)


def assign(
    parties: Mapping[str, int], tiers: Tiers | None, tier_archs: Sequence[str], largest: str
) -> dict[str, str]:
    """Station name -> the architecture it serves (``parties``: name -> party id)."""
    return {
        name: architecture_of(party, tiers, tier_archs, largest)
        for name, party in sorted(parties.items())
    }


def stations_by_architecture(
    assignment: Mapping[str, str], tier_archs: Iterable[str]
) -> dict[str, tuple[str, ...]]:
    """Architecture -> its stations, every architecture of ``tier_archs`` included.

    A tier architecture no station ended up with is an error: its model would be
    published for nobody (a job's tiers are formed from the stations that answered)."""
    wanted = list(dict.fromkeys(tier_archs))
    if not wanted:
        raise TierArchitectureError("tier_archs names no architecture")
    stations: dict[str, list[str]] = {arch: [] for arch in wanted}
    for name, arch in sorted(assignment.items()):
        if arch not in stations:
            raise TierArchitectureError(
                f"station {name} was assigned {arch!r}, which is not one of tier_archs {wanted}"
            )
        stations[arch].append(name)
    empty = [arch for arch, names in stations.items() if not names]
    if empty:
        raise TierArchitectureError(
            f"no station is in the tier of {', '.join(empty)} (tiers were formed from "
            f"{len(assignment)} station(s): {dict(sorted(assignment.items()))}); use fewer "
            "tiers, or more training stations; nothing is published"
        )
    return {arch: tuple(names) for arch, names in stations.items()}


def check_tier_archs(value: object, tiers: int, kind: str = "distill") -> tuple[str, ...]:
    """A manifest's ``tier_archs`` for ``tiers`` tiers: one non-empty name per tier."""
    if value is None:
        raise TierArchitectureError(
            f"strategy.params.tier_archs: kind {kind!r} needs one architecture per tier, "
            'fastest first (e.g. tier_archs = ["cnn-large", "cnn-small"])'
        )
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(a, str) and a.strip() for a in value)
    ):
        raise TierArchitectureError(
            f"strategy.params.tier_archs must be a non-empty list of architecture names, "
            f"got {value!r}"
        )
    if len(value) != tiers:
        raise TierArchitectureError(
            f"strategy.params.tier_archs needs one architecture per tier: {tiers} tier(s), "
            f"{len(value)} architecture(s)"
        )
    return tuple(value)

"""Adding the stations' statistics into the fleet's anomaly model (pure).

Every station counts once: a second reply from the same node (a retried message) is
left out and reported, never added twice, since a statistic added twice would weigh that
station's parts double. Failed replies are data (the station's reason), not a hang.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from fedge.aggregator.errors import AggregatorError
from fedge.models.anomaly.statistics import (
    GaussianFit,
    SufficientStatistics,
    add_statistics,
    fit,
)


@dataclass(frozen=True, eq=False)
class StationReply:
    """One station's answer: its statistics, or why it has none."""

    node_id: int
    edge: str
    stats: SufficientStatistics | None
    error: str | None = None


@dataclass(frozen=True, eq=False)
class FleetFit:
    """The fleet's model, the statistics it was fitted from, and who contributed what."""

    model: GaussianFit
    summed: SufficientStatistics
    counts: dict[str, int]
    """Good parts per contributing station (by edge)."""
    failures: dict[str, str]
    duplicates: tuple[str, ...]


class NoStatisticsError(AggregatorError, ValueError):
    """No station answered with statistics: there is nothing to fit."""


def combine(replies: Sequence[StationReply]) -> FleetFit:
    """The fit of the sum of every station's statistics, each station counted once."""
    seen: set[int] = set()
    shares: list[SufficientStatistics] = []
    counts: dict[str, int] = {}
    failures: dict[str, str] = {}
    duplicates: list[str] = []
    for reply in replies:
        if reply.node_id in seen:
            duplicates.append(reply.edge)
            continue
        seen.add(reply.node_id)
        if reply.stats is None:
            failures[reply.edge] = reply.error or "no statistics in the reply"
            continue
        shares.append(reply.stats)
        counts[reply.edge] = reply.stats.count
    if not shares:
        raise NoStatisticsError(
            f"no station answered with good-part statistics (failures: {failures}); label "
            "good parts at the stations and run the job again"
        )
    summed = add_statistics(shares)
    return FleetFit(
        model=fit(summed),
        summed=summed,
        counts=counts,
        failures=failures,
        duplicates=tuple(duplicates),
    )

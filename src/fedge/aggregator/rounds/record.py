"""What a round was: the record every strategy emits and observers (run store, simulator)
consume. Plain values only, so it serialises to SQLite and JSON as is."""

from collections.abc import Callable
from dataclasses import dataclass, field

from fedge.aggregator.rounds.deadline import RoundPlan, Settlement


@dataclass(frozen=True)
class RoundRecord:
    server_round: int
    selected: tuple[int, ...]
    on_time: tuple[int, ...]
    late: tuple[int, ...]
    failed: tuple[int, ...]
    round_time_s: float  # virtual seconds in simulation, wall seconds in deployment
    elapsed_s: float  # the run's clock at the end of this round
    quorum: int
    quorum_met: bool
    deadline_s: float | None
    tier: int | None = None
    stale_folded: int = 0  # late replies of earlier rounds folded into this one
    train_metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)


RoundObserver = Callable[[RoundRecord], None]


def settled_record(
    server_round: int,
    plan: RoundPlan,
    settlement: Settlement,
    *,
    tier: int | None,
    elapsed_s: float,
    stale_folded: int,
    train_metrics: dict[str, float],
    failures: dict[int, str],
) -> RoundRecord:
    """The record of a round that ended as ``settlement`` says, planned as ``plan``."""
    return RoundRecord(
        server_round=server_round,
        selected=tuple(plan.selected),
        on_time=tuple(settlement.on_time),
        late=tuple(settlement.late),
        failed=tuple(settlement.failed),
        round_time_s=settlement.round_time_s,
        elapsed_s=elapsed_s,
        quorum=plan.quorum,
        quorum_met=settlement.quorum_met,
        deadline_s=plan.deadline_s,
        tier=tier,
        stale_folded=stale_folded,
        train_metrics=train_metrics,
        failures=failures,
    )


def summary(record: RoundRecord) -> str:
    """The one line the aggregator logs per round."""
    return (
        f"round {record.server_round}: tier {record.tier}, "
        f"{len(record.on_time)}/{len(record.selected)} on time, {len(record.late)} late, "
        f"{len(record.failed)} failed, {record.round_time_s:.2f}s"
    )

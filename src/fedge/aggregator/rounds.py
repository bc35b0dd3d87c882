"""What a round was: the record every strategy emits and observers (run store, simulator)
consume. Plain values only, so it serialises to SQLite and JSON as is."""

from collections.abc import Callable
from dataclasses import dataclass, field


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

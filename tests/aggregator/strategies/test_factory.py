"""A strategy table may set its own local step (lr, batch size) over the task's."""

import pytest

from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.strategies.factory import (
    LOCAL_STEP_KEYS,
    StrategyConfigError,
    build_strategy,
)


def test_a_strategy_sets_its_own_learning_rate_and_batch_size() -> None:
    _, config = build_strategy(
        "tiered-dp",
        {"kind": "tiered", "tiers": 2, "batch_size": 128, "lr": 0.2},
        per_round=2,
        seed=0,
        clock=ClockMode.VIRTUAL,
    )
    assert config == {"lr": 0.2, "batch-size": 128}  # the parties' config keys
    assert set(config) <= LOCAL_STEP_KEYS  # what a fleet job passes on over its task
    _, plain = build_strategy("fedavg", {}, per_round=2, seed=0, clock=ClockMode.VIRTUAL)
    assert plain == {}  # nothing set: the task's own step


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"batch_size": 0}, "batch_size must be > 0"),
        ({"lr": -0.1}, "lr must be > 0"),
        ({"batch_size": 12.5}, "batch_size: expected int"),
    ],
)
def test_a_bad_local_step_is_refused_by_name(params: dict[str, object], message: str) -> None:
    with pytest.raises(StrategyConfigError, match=message):
        build_strategy("fedavg", params, per_round=2, seed=0, clock=ClockMode.VIRTUAL)

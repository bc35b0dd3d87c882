"""Who plays a job's rounds: our strategy, Flower's central-DP wrapper, or SecAgg+.

A strategy's ``privacy`` (``[privacy]`` of a scenario or manifest) decides:

- nothing private, or DP-SGD on the parties: our own round (``StreamingFedAvg.start``),
  with streaming folds, deadlines and quorum;
- ``mode = "central"``: Flower's ``DifferentialPrivacyServerSideFixedClipping`` around
  the strategy (:mod:`fedge.aggregator.privacy.central_dp`);
- ``secagg = true``: Flower's SecAgg+ workflow, planned and recorded by the strategy
  (:mod:`fedge.aggregator.privacy.secagg`), DP-SGD on the parties or not.

Each plays only its round; what surrounds a round (round 0 evaluation, metrics,
evaluation, observers, checkpoints) is the one loop,
:func:`fedge.aggregator.rounds.loop.run_rounds`.

The simulator, simulated jobs and fleet jobs all start their rounds here, so a privacy
setting means the same thing wherever it is given.
"""

from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedge.aggregator.privacy import central_dp, secagg
from fedge.aggregator.rounds.loop import CheckpointFn, EvaluateFn
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.privacy.settings import PrivacyMode


def start_rounds(
    strategy: StreamingFedAvg,
    grid: Grid,
    initial_arrays: ArrayRecord,
    *,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord | None = None,
    evaluate_fn: EvaluateFn | None = None,
    first_round: int = 1,
    checkpoint_fn: CheckpointFn | None = None,
    max_weight: float = secagg.DEFAULT_MAX_WEIGHT,
) -> tuple[Result, central_dp.CentralDP | None]:
    """Run rounds ``first_round..num_rounds``; the central-DP wrapper when one was used.

    ``max_weight``: under SecAgg+, at least the largest ``num-examples`` a party reports.

    Raises :class:`PrivacyError` before any training when central DP's rounds would cost
    more than the job's ``privacy.epsilon``.
    """
    spec = strategy.privacy
    central_dp.check_rounds(spec, num_rounds)
    # SecAgg+ with central DP is refused where strategies are built (factory._privacy).
    if spec.secagg:
        strategy.plan_privacy(num_rounds)
        settings = secagg.SecAggSettings.from_privacy(spec, max_weight=max_weight)
        result = secagg.run_secagg(
            grid,
            strategy,
            initial_arrays,
            settings,
            num_rounds=num_rounds,
            train_config=train_config,
            timeout=timeout,
            first_round=first_round,
            evaluate_fn=evaluate_fn,
            checkpoint_fn=checkpoint_fn,
        )
        return result, None
    if spec.mode is PrivacyMode.CENTRAL:
        wrapper = central_dp.CentralDP(strategy)
        result = wrapper.start(
            grid,
            initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_fn=evaluate_fn,
            first_round=first_round,
            checkpoint_fn=checkpoint_fn,
        )
        return result, wrapper
    result = strategy.start(
        grid,
        initial_arrays,
        num_rounds=num_rounds,
        timeout=timeout,
        train_config=train_config,
        evaluate_fn=evaluate_fn,
        first_round=first_round,
        checkpoint_fn=checkpoint_fn,
    )
    return result, None

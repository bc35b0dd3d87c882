"""Central DP: Flower's server-side clipping wrapper composed with our strategies.

McMahan et al. (ICLR 2018, "Learning differentially private recurrent language models"):
the server clips every party's update (its model minus the one sent) to ``C`` and adds
Gaussian noise of standard deviation ``sigma * C / n`` to the mean of ``n`` updates. One
station changes the sum by at most ``C``, so each round is a Gaussian mechanism with
noise multiplier ``sigma`` at the *station* level. We account it with the RDP accountant
without amplification by sampling (tier selection is not the uniform Poisson sampling the
amplification theorem needs), composed over the rounds run -- an upper bound for every
station, which trains in at most that many rounds.

Flower's :class:`DifferentialPrivacyServerSideFixedClipping` does the clipping and the
noise; it drives our strategy through Flower's own ``Strategy.start``, which our
strategies honour (``aggregate_train`` settles a round as our loop does). Two things the
sensitivity bound needs are enforced here:

- every update counts the same (the bound is ``C / n`` only for an unweighted mean), so
  the replies' ``num-examples`` are set to 1 before our strategy folds them;
- every selected party is in the mean: no deadline, over-selection or quorum below 1
  (checked when the strategy is built, :func:`check_strategy`); a round with a failed
  party is skipped by Flower's wrapper (nothing released, nothing spent).
"""

import dataclasses
from collections.abc import Callable, Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, Result

from fedge.aggregator.replies import NUM_EXAMPLES
from fedge.aggregator.rounds import RoundRecord
from fedge.aggregator.streaming import StreamingFedAvg
from fedge.privacy.accounting import epsilon_spent
from fedge.privacy.settings import DpRelease, PrivacyError, PrivacyMode, PrivacySpec


class CentralDP(DifferentialPrivacyServerSideFixedClipping):
    """Flower's server-side fixed clipping over a fedge strategy, accounted per round."""

    def __init__(self, strategy: StreamingFedAvg) -> None:
        spec = strategy.privacy
        check_strategy(strategy)
        assert spec.noise_multiplier is not None  # PrivacySpec requires it for central
        # Federated evaluation would send every party the model each round; the job's own
        # evaluation (evaluate_fn) is what reports accuracy.
        strategy.fraction_evaluate = 0.0
        super().__init__(strategy, spec.noise_multiplier, spec.clipping_norm, strategy.per_round)
        self.spec = spec
        self.released = 0  # rounds whose noised aggregate was released
        self.epsilon_by_round: dict[int, float] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The noise is sized for the parties this round asks (TiFL's profiling round asks
        everyone, a tier round ``per_round``): sigma * C / n on their mean."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.num_sampled_clients = max(1, len(messages))
        return messages

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        first_round: int = 1,
        checkpoint_fn: Callable[[int, ArrayRecord], None] | None = None,
    ) -> Result:
        """Flower's round (configure, send and wait for all, aggregate), resumable like ours.

        A resumed job counts every round before ``first_round`` as released: an upper
        bound on what was spent (a skipped round released nothing).
        """
        config = train_config or ConfigRecord()
        result = Result()
        arrays = initial_arrays
        self.released = max(self.released, first_round - 1)
        if evaluate_fn is not None and first_round == 1:
            initial = evaluate_fn(0, arrays)
            if initial is not None:
                result.evaluate_metrics_serverapp[0] = initial
        # Our strategy reports a round when it folds it; its observers should see the
        # round's evaluation too, as in our own loop: hold the record until evaluated.
        inner = self.strategy
        assert isinstance(inner, StreamingFedAvg)
        observers, held = inner.observers, list[RoundRecord]()
        inner.observers = [held.append]
        try:
            for server_round in range(first_round, num_rounds + 1):
                messages = self.configure_train(server_round, arrays, config, grid)
                replies = grid.send_and_receive(messages, timeout=timeout)
                new_arrays, metrics = self.aggregate_train(server_round, replies)
                if new_arrays is not None:
                    arrays = new_arrays
                if metrics is not None:
                    result.train_metrics_clientapp[server_round] = metrics
                evaluated = evaluate_fn(server_round, arrays) if evaluate_fn else None
                if evaluated is not None:
                    result.evaluate_metrics_serverapp[server_round] = evaluated
                for record in held:
                    if evaluated is not None:
                        scores = {k: float(v) for k, v in evaluated.items()}  # type: ignore[arg-type]
                        record = dataclasses.replace(record, eval_metrics=scores)
                    for observer in observers:
                        observer(record)
                held.clear()
                if checkpoint_fn is not None:
                    checkpoint_fn(server_round, arrays)
        finally:
            inner.observers = observers
        result.arrays = arrays
        return result

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        for reply in replies:
            if reply.has_error():
                continue
            for record in reply.content.metric_records.values():
                if NUM_EXAMPLES in record:
                    record[NUM_EXAMPLES] = 1
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            self.released += 1
            epsilon = station_epsilon(self.spec, self.released)
            self.epsilon_by_round[server_round] = epsilon
            metrics = MetricRecord(dict(metrics or {}))
            metrics["dp-epsilon-job"] = epsilon
        return arrays, metrics


def check_strategy(strategy: StreamingFedAvg) -> None:
    """Central DP's bound holds only if every selected party is folded, unweighted."""
    spec = strategy.privacy
    if spec.mode is not PrivacyMode.CENTRAL:
        raise PrivacyError(f"central DP needs privacy.mode = 'central', got {spec.mode.value!r}")
    deadline = strategy.deadline
    if deadline.deadline_factor or deadline.over_selection or deadline.quorum_fraction < 1:
        raise PrivacyError(
            "privacy.mode = 'central' needs every selected party in each mean (its noise is "
            "sized for per_round updates): remove deadline_factor, over_selection and "
            "quorum_fraction from the strategy"
        )


def station_epsilon(spec: PrivacySpec, rounds: int) -> float:
    """Station-level epsilon after ``rounds`` released rounds (no sampling amplification)."""
    if rounds < 1:
        return 0.0
    assert spec.noise_multiplier is not None
    release = DpRelease(noise_multiplier=spec.noise_multiplier, sample_rate=1.0, steps=rounds)
    return epsilon_spent([release], spec.delta, spec.accountant)

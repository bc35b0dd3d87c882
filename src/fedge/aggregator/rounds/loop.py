"""The one outer round loop: evaluation, metrics, observers and checkpoints around a round.

Every way fedge runs rounds -- our streaming FedAvg (:meth:`StreamingFedAvg.start`),
Flower's central-DP wrapper (:meth:`CentralDP.start`) and SecAgg+ (:func:`run_secagg`) --
differs only in how one round is played. Each hands its round to :func:`run_rounds` as a
:data:`PlayRound`; what surrounds a round is written here once, so it means the same under
every protocol:

- round 0 (the starting model) is evaluated when the run starts at round 1, never on a
  resume (its evaluation is already recorded);
- after each round: its train metrics into Flower's ``Result``, then the job's evaluation
  of the new model, then the round's record -- carrying that evaluation -- to every
  observer (the run store, the simulator's curves), then the checkpoint. A checkpoint
  therefore always follows a recorded round, and a resumed run continues at the round
  after the checkpoint's;
- the round may stop the run before it starts (every party out of privacy budget, central
  DP's epsilon spent) or after its checkpoint (central DP's bound reached mid-round).

Flower's ``Strategy.start`` has the same shape (``serverapp/strategy/strategy.py``); ours
adds resuming (``first_round``), checkpoints, and records observers read.
"""

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp.strategy import Result

from fedge.aggregator.rounds.record import RoundObserver, RoundRecord

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
"""The job's evaluation of a round's model: (round, model) -> metrics (round 0: the start)."""
CheckpointFn = Callable[[int, ArrayRecord], None]
"""Called with (round, model) after each round's observers (may raise to halt the run)."""


@dataclass(frozen=True)
class RoundOutcome:
    """What one round played: the model after it, its record, and its train metrics."""

    arrays: ArrayRecord
    record: RoundRecord
    train_metrics: MetricRecord | None
    """What ``Result.train_metrics_clientapp`` holds for the round (None: nothing)."""
    last: bool = False
    """Stop the run after this round (once it is evaluated, observed and checkpointed)."""

    @classmethod
    def of(cls, arrays: ArrayRecord, record: RoundRecord) -> "RoundOutcome":
        """A round whose train metrics are its record's (our loop's and SecAgg+'s)."""
        metrics = MetricRecord(dict(record.train_metrics)) if record.train_metrics else None
        return cls(arrays, record, metrics)


PlayRound = Callable[[int, ArrayRecord], RoundOutcome | None]
"""Plays round ``server_round`` from ``arrays``; None stops the run before that round."""


def run_rounds(
    play: PlayRound,
    initial_arrays: ArrayRecord,
    *,
    num_rounds: int,
    first_round: int = 1,
    observers: Sequence[RoundObserver] = (),
    evaluate_fn: EvaluateFn | None = None,
    checkpoint_fn: CheckpointFn | None = None,
) -> Result:
    """Play rounds ``first_round..num_rounds`` (a resumed run starts past round 1).

    ``observers`` is read at every round, so a list the caller appends to later is seen.
    """
    result = Result()
    arrays = initial_arrays
    if evaluate_fn is not None and first_round == 1:
        initial = evaluate_fn(0, arrays)
        if initial is not None:
            result.evaluate_metrics_serverapp[0] = initial
    for server_round in range(first_round, num_rounds + 1):
        outcome = play(server_round, arrays)
        if outcome is None:
            break
        arrays, record = outcome.arrays, outcome.record
        if outcome.train_metrics is not None:
            result.train_metrics_clientapp[server_round] = outcome.train_metrics
        if evaluate_fn is not None:
            evaluated = evaluate_fn(server_round, arrays)
            if evaluated is not None:
                result.evaluate_metrics_serverapp[server_round] = evaluated
                # Observers see the round with its evaluation (the run store keeps both).
                scores = {k: float(v) for k, v in evaluated.items()}  # type: ignore[arg-type]
                record = dataclasses.replace(record, eval_metrics=scores)
        for observer in observers:
            observer(record)
        if checkpoint_fn is not None:
            checkpoint_fn(server_round, arrays)
        if outcome.last:
            break
    result.arrays = arrays
    return result

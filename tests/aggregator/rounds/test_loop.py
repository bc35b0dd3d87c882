"""The one round loop, fed a fake round: what surrounds a round, in order, once."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.serverapp.strategy import Result

from fedge.aggregator.rounds.loop import RoundOutcome, run_rounds
from fedge.aggregator.rounds.record import RoundRecord


def _model(value: float) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.full(2, value, dtype=np.float32))})


def _value(arrays: ArrayRecord) -> float:
    return float(arrays["w"].numpy()[0])


def _record(server_round: int, **train: float) -> RoundRecord:
    return RoundRecord(
        server_round=server_round,
        selected=(1, 2),
        on_time=(1, 2),
        late=(),
        failed=(),
        round_time_s=1.0,
        elapsed_s=float(server_round),
        quorum=2,
        quorum_met=True,
        deadline_s=None,
        train_metrics=dict(train),
    )


class Fleet:
    """A fake round (each adds 1 to the model) and a log of everything the loop calls."""

    def __init__(self, *, stop_before: int | None = None, last: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.observed: list[RoundRecord] = []
        self.checkpoints: dict[int, float] = {}
        self.stop_before = stop_before
        self.last = last

    def play(self, server_round: int, arrays: ArrayRecord) -> RoundOutcome | None:
        if server_round == self.stop_before:
            return None
        self.calls.append(("play", server_round))
        record = _record(server_round, loss=1.0 / server_round)
        outcome = RoundOutcome.of(_model(_value(arrays) + 1), record)
        return RoundOutcome(
            outcome.arrays, record, outcome.train_metrics, last=server_round == self.last
        )

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        self.calls.append(("evaluate", server_round))
        return MetricRecord({"accuracy": _value(arrays) / 10})

    def observe(self, record: RoundRecord) -> None:
        self.calls.append(("observe", record.server_round))
        self.observed.append(record)

    def checkpoint(self, server_round: int, arrays: ArrayRecord) -> None:
        self.calls.append(("checkpoint", server_round))
        self.checkpoints[server_round] = _value(arrays)

    def run(self, num_rounds: int, first_round: int = 1, start: float = 0.0) -> Result:
        return run_rounds(
            self.play,
            _model(start),
            num_rounds=num_rounds,
            first_round=first_round,
            observers=[self.observe],
            evaluate_fn=self.evaluate,
            checkpoint_fn=self.checkpoint,
        )


def test_round_zero_is_evaluated_then_each_round_played_evaluated_observed_checkpointed() -> None:
    fleet = Fleet()
    result = fleet.run(3)
    assert fleet.calls == [
        ("evaluate", 0),
        *[(step, r) for r in (1, 2, 3) for step in ("play", "evaluate", "observe", "checkpoint")],
    ]
    assert _value(result.arrays) == 3.0
    assert fleet.checkpoints == {1: 1.0, 2: 2.0, 3: 3.0}
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2, 3]
    assert result.evaluate_metrics_serverapp[2]["accuracy"] == pytest.approx(0.2)
    assert result.train_metrics_clientapp[2]["loss"] == pytest.approx(0.5)
    # Observers see each round once, with its evaluation.
    assert [r.server_round for r in fleet.observed] == [1, 2, 3]
    assert fleet.observed[2].eval_metrics == {"accuracy": pytest.approx(0.3)}
    assert fleet.observed[2].train_metrics == {"loss": pytest.approx(1 / 3)}


def test_a_resumed_run_continues_after_its_checkpoint_without_round_zero() -> None:
    straight = Fleet()
    straight.run(5)
    resumed = Fleet()
    result = resumed.run(5, first_round=3, start=straight.checkpoints[2])
    assert resumed.calls[0] == ("play", 3)
    assert ("evaluate", 0) not in resumed.calls
    assert resumed.checkpoints == {r: straight.checkpoints[r] for r in (3, 4, 5)}
    assert sorted(result.evaluate_metrics_serverapp) == [3, 4, 5]
    assert _value(result.arrays) == 5.0


def test_past_the_last_round_nothing_is_played_and_the_model_is_the_one_given() -> None:
    fleet = Fleet()
    result = fleet.run(4, first_round=5, start=4.0)
    assert fleet.calls == []
    assert _value(result.arrays) == 4.0
    assert result.train_metrics_clientapp == {} and result.evaluate_metrics_serverapp == {}


def test_a_round_that_cannot_start_stops_the_run_before_it() -> None:
    fleet = Fleet(stop_before=3)
    result = fleet.run(5)
    assert fleet.checkpoints == {1: 1.0, 2: 2.0}
    assert [r.server_round for r in fleet.observed] == [1, 2]
    assert _value(result.arrays) == 2.0


def test_a_last_round_is_evaluated_observed_and_checkpointed_then_the_run_stops() -> None:
    fleet = Fleet(last=2)
    result = fleet.run(5)
    assert fleet.calls[-4:] == [("play", 2), ("evaluate", 2), ("observe", 2), ("checkpoint", 2)]
    assert fleet.checkpoints == {1: 1.0, 2: 2.0}
    assert _value(result.arrays) == 2.0


def test_a_checkpoint_that_halts_leaves_the_round_observed() -> None:
    fleet = Fleet()

    def halt_after_2(server_round: int, arrays: ArrayRecord) -> None:
        fleet.checkpoint(server_round, arrays)
        if server_round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_rounds(
            fleet.play,
            _model(0.0),
            num_rounds=5,
            observers=[fleet.observe],
            checkpoint_fn=halt_after_2,
        )
    assert [r.server_round for r in fleet.observed] == [1, 2]
    assert fleet.checkpoints == {1: 1.0, 2: 2.0}


def test_without_evaluation_observers_see_the_record_as_played_and_no_metrics_are_kept() -> None:
    fleet = Fleet()
    late: list[int] = []
    observers = [fleet.observe]

    def play(server_round: int, arrays: ArrayRecord) -> RoundOutcome | None:
        if server_round == 1:
            observers.append(lambda record: late.append(record.server_round))
        return RoundOutcome(arrays, _record(server_round), None)

    result = run_rounds(play, _model(0.0), num_rounds=2, observers=observers)
    assert [r.eval_metrics for r in fleet.observed] == [{}, {}]
    assert result.train_metrics_clientapp == {} and result.evaluate_metrics_serverapp == {}
    assert late == [1, 2]  # an observer added while running is called from that round on

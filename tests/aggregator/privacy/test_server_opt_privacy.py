"""Server optimizers under central DP (issue 29): the step is taken on the noised release,
never on the clean mean, and costs no epsilon (post-processing). A toy ClientApp on the
in-process grid (no training, no processes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.aggregator.driver import start_rounds
from fedge.aggregator.privacy.central_dp import CentralDP, station_epsilon
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.rounds.replies import arrays_of
from fedge.aggregator.strategies.factory import build_strategy
from fedge.aggregator.strategies.server_opt import ServerOptState, server_step
from fedge.sim.grid import InProcessGrid

PARTIES = 4
ROUNDS = 3
party = ClientApp()


@party.train()
def _train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    sent = msg.content.array_records["arrays"]
    arrays = ArrayRecord({k: Array(v.numpy() + 0.05 * (partition + 1)) for k, v in sent.items()})
    metrics = MetricRecord({"num-examples": 10, "virtual-time-s": 1.0 + partition})
    return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


def test_central_dp_steps_the_optimizer_on_the_noised_release_at_no_extra_epsilon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    privacy = {"mode": "central", "noise_multiplier": 1.0, "clipping_norm": 0.5}
    strategy, _ = build_strategy(
        "s", {"kind": "fedavg", "server_opt": "fedadam", "server_lr": 0.1, "privacy": privacy},
        per_round=PARTIES, seed=0, clock=ClockMode.VIRTUAL,
    )  # fmt: skip
    # Spy on Flower's noise: every noised aggregate, and the clean mean it was added to.
    released: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
    original = CentralDP._add_noise_to_aggregated_arrays

    def spy(self: CentralDP, aggregated: ArrayRecord) -> Any:
        clean = {k: v.copy() for k, v in arrays_of(aggregated).items()}
        noised = original(self, aggregated)
        released.append((clean, arrays_of(noised)))
        return noised

    monkeypatch.setattr(CentralDP, "_add_noise_to_aggregated_arrays", spy)
    models: dict[int, dict[str, np.ndarray]] = {}

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        models[server_round] = {k: v.copy() for k, v in arrays_of(arrays).items()}
        return MetricRecord({"accuracy": 0.5})

    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    initial = ArrayRecord({"w": Array(np.zeros(8, np.float32))})
    grid = InProcessGrid(party, PARTIES)
    try:
        _, wrapper = start_rounds(
            strategy, grid, initial, num_rounds=ROUNDS, timeout=30, evaluate_fn=evaluate
        )
    finally:
        grid.close()
    assert wrapper is not None and len(released) == ROUNDS
    assert strategy.server_opt is not None
    state = ServerOptState()
    for server_round, (clean, noised) in enumerate(released, start=1):
        assert not np.array_equal(clean["w"], noised["w"])  # the noise was there
        expected, state = server_step(strategy.server_opt, state, models[server_round - 1], noised)
        np.testing.assert_array_equal(models[server_round]["w"], expected["w"])
    assert strategy.server_opt_state.step == ROUNDS
    # Post-processing: the epsilon is the plain release's, round for round.
    assert records[-1].train_metrics["dp-epsilon-station"] == station_epsilon(wrapper.spec, ROUNDS)

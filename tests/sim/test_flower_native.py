"""Flower's own strategies as the simulator's peer (issue 29): built from a scenario table,
timed on the virtual clock like fedge's rounds. A toy ClientApp on the in-process grid."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdam, FedAvgM

from fedge.sim.errors import SimError
from fedge.sim.flower_native import _VirtualClock, build_native, is_native
from fedge.sim.grid import InProcessGrid

toy = ClientApp()


@toy.train()
def _train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    sent = msg.content.array_records["arrays"]
    arrays = ArrayRecord({k: Array(v.numpy() + 0.1 * (partition + 1)) for k, v in sent.items()})
    metrics = MetricRecord({"num-examples": 5, "virtual-time-s": 2.0 + partition})
    return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


def test_a_table_builds_flowers_own_strategy_with_fedges_names() -> None:
    params: dict[str, object] = {
        "kind": "flwr-fedadam",
        "server_lr": 0.03,
        "beta1": 0.8,
        "tau": 0.01,
    }
    assert is_native(params) and not is_native({"kind": "tiered"})
    adam = build_native("a", params, per_round=2, parties=4)
    assert isinstance(adam, FedAdam)
    assert (adam.eta, adam.beta_1, adam.tau, adam.fraction_train) == (0.03, 0.8, 0.01, 0.5)
    momentum = build_native(
        "m", {"kind": "flwr-fedavgm", "server_lr": 1.0, "beta1": 0.9}, per_round=2, parties=4
    )
    assert isinstance(momentum, FedAvgM) and momentum.server_momentum == 0.9
    with pytest.raises(
        SimError, match=r"strategies.m.tau: not a parameter of Flower's flwr-fedavgm"
    ):
        build_native("m", {"kind": "flwr-fedavgm", "tau": 0.1}, per_round=2, parties=4)
    with pytest.raises(SimError, match="expected a number"):
        build_native("a", {"kind": "flwr-fedadam", "server_lr": "fast"}, per_round=2, parties=4)


def test_flowers_round_lasts_as_long_as_its_slowest_party() -> None:
    strategy = build_native("a", {"kind": "flwr-fedadam"}, per_round=3, parties=3)
    grid = InProcessGrid(toy, 3)
    try:
        clock = _VirtualClock(grid)
        result = strategy.start(
            grid=clock,
            initial_arrays=ArrayRecord({"w": Array(np.zeros(4, np.float32))}),
            num_rounds=2,
            train_config=ConfigRecord({"lr": 0.1}),
        )
    finally:
        grid.close()
    assert [r.round_time_s for r in clock.records] == [4.0, 4.0]  # partition 2: 2 + 2 s
    assert [r.elapsed_s for r in clock.records] == [4.0, 8.0]
    assert all(len(r.on_time) == 3 and not r.failed for r in clock.records)
    assert float(result.arrays["w"].numpy()[0]) > 0  # Flower's FedAdam stepped the model

"""A server optimizer under SecAgg+ (issue 29) steps on the unmasked aggregate -- the only
thing the server ever learns -- on Flower's simulation runtime (Ray, 6 parties)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context
from flwr.common import parameters_to_ndarrays
from flwr.serverapp import Grid, ServerApp

from fedge.aggregator.fleet.identity import PartitionOrderedGrid
from fedge.aggregator.privacy.secagg import SecAggSettings, run_secagg
from fedge.aggregator.privacy.secagg_round import SecAggRound
from fedge.aggregator.strategies.server_opt import ServerOptConfig, ServerOptState, server_step
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.bench.secagg_apps import secagg_app
from fedge.sim.flower_backend import launch_simulation

pytestmark = pytest.mark.integration

PARTIES = 6
SETTINGS = SecAggSettings(reconstruction_threshold=0.5, max_weight=16.0, key_stage_timeout_s=30)
OPT = ServerOptConfig("fedadam", 0.05)


def initial() -> ArrayRecord:
    rng = np.random.default_rng(3)
    return ArrayRecord(
        {
            "weight": Array(rng.standard_normal((6, 5)).astype(np.float32)),
            "bias": Array(np.linspace(-1, 1, 5).astype(np.float32)),
        }
    )


def test_secagg_steps_the_server_optimizer_on_the_unmasked_aggregate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {"aggregates": []}
    original = SecAggRound.aggregate_fit

    def spy(self: SecAggRound, server_round: int, results: Any, failures: Any) -> Any:
        seen["aggregates"].append(parameters_to_ndarrays(results[0][1].parameters))
        return original(self, server_round, results, failures)

    monkeypatch.setattr(SecAggRound, "aggregate_fit", spy)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        ordered = PartitionOrderedGrid(grid)
        end = time.monotonic() + 60
        while len(list(ordered.get_node_ids())) < PARTIES:
            assert time.monotonic() < end, f"fewer than {PARTIES} parties joined"
            time.sleep(0.2)
        strategy = StreamingFedAvg(per_round=PARTIES, server_opt=OPT)
        result = run_secagg(ordered, strategy, initial(), SETTINGS, num_rounds=2, timeout=30)
        seen["model"] = {k: a.numpy() for k, a in result.arrays.items()}
        seen["steps"] = strategy.server_opt_state.step

    launch_simulation(server_app, secagg_app, PARTIES, {"seed": 1})
    assert seen["steps"] == 2 and len(seen["aggregates"]) == 2
    model = {k: a.numpy() for k, a in initial().items()}
    state = ServerOptState()
    for aggregate in seen["aggregates"]:  # the arrays in the model's order
        mean = {
            key: np.asarray(value, dtype=model[key].dtype).reshape(model[key].shape)
            for key, value in zip(model, aggregate, strict=True)
        }
        model, state = server_step(OPT, state, model, mean)
    for key, value in model.items():
        np.testing.assert_array_equal(seen["model"][key], value)
    # The optimizer moved the model somewhere the plain aggregate would not have.
    last = np.asarray(seen["aggregates"][-1][0]).reshape(model["weight"].shape)
    assert not np.allclose(seen["model"]["weight"], last)

"""The simulator at fleet size (issue 29): parties' data drawn lazily, a fleet resized
from the command line, nodes made when first asked."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flwr.app import Context, Message

from fedge.aggregator.fleet.grids import NODE_ID_BASE
from fedge.sim import data as sim_data
from fedge.sim.data import DRAWS_KEPT, make_partitions
from fedge.sim.grid import InProcessGrid
from fedge.sim.party_inputs import PARTIES_KEY, PartyConfigError, party_from_context
from fedge.sim.runner import run_config
from fedge.sim.scenario import Scenario, ScenarioError, load_scenario, parse_scenario


@pytest.fixture(scope="module")
def fleet() -> Scenario:
    return load_scenario("fleet-scale")


def test_a_party_draws_the_same_data_whoever_asks_and_in_any_order(fleet: Scenario) -> None:
    parts = make_partitions(fleet, seed=3)
    assert parts.num_parties == 1000
    late_first = [parts.party_indices[p] for p in (999, 5, 500)]
    sim_data._partitions.cache_clear()
    again = make_partitions(fleet, seed=3)
    in_order = [again.party_indices[p] for p in (5, 500, 999)]
    assert np.array_equal(late_first[0], in_order[2])
    assert np.array_equal(late_first[1], in_order[0])
    # Data, sizes and the split into training and validation agree with each other.
    x, y = again.parties[5]
    vx, vy = again.validation[5]
    assert x.shape == (len(again.party_indices[5]), 64) and len(y) == len(x)
    assert again.party_size(5) == len(y) + len(vy) == len(x) + len(vx)
    # Drawn from the pool only: never a test or proxy image.
    held_out = set(again.test_indices) | set(again.proxy_indices)
    assert not held_out & set(np.concatenate([again.party_indices[5], again.validation_indices[5]]))
    other = make_partitions(fleet, seed=4)
    assert not np.array_equal(other.party_indices[5], again.party_indices[5])


def test_sizes_are_known_without_drawing_and_memory_stays_bounded(fleet: Scenario) -> None:
    big = fleet.with_parties(10_000)
    parts = make_partitions(big, seed=0)
    assert parts.num_parties == 10_000
    assert sum(parts.party_size(p) for p in range(10_000)) == 10_000 * 40
    draws = parts.parties._make.__closure__  # type: ignore[attr-defined]
    assert draws is not None
    for p in range(0, 10_000, 7):
        parts.party_indices[p]
    kept = next(
        cell.cell_contents for cell in draws if isinstance(cell.cell_contents, sim_data._Draws)
    )._kept
    assert len(kept) == DRAWS_KEPT


def test_a_scenario_resizes_keeping_its_shares() -> None:
    tifl = load_scenario("tifl-digits")  # 5 groups of 10
    grown = tifl.with_parties(1000)
    assert [g.count for g in grown.fleet.groups] == [200] * 5
    assert grown.fleet.per_round == tifl.fleet.per_round
    odd = tifl.with_parties(7)
    assert sum(g.count for g in odd.fleet.groups) == 7
    assert min(g.count for g in odd.fleet.groups) >= 1
    assert load_scenario("fleet-scale").with_parties(10).fleet.per_round == 10
    with pytest.raises(ScenarioError, match="fewer than the scenario's 5"):
        tifl.with_parties(4)
    lognormal = load_scenario("fleet-scale").with_parties(12_345)
    assert lognormal.fleet.parties == 12_345 and lognormal.fleet.groups == ()


def test_a_resized_fleet_reaches_its_parties_through_the_run_config(fleet: Scenario) -> None:
    big = fleet.with_parties(5000)
    config = run_config(big, seed=1)
    assert config[PARTIES_KEY] == 5000
    context = Context(
        run_id=1,
        node_id=NODE_ID_BASE + 4321,
        node_config={"partition-id": 4321, "num-partitions": 5000},
        state=None,  # type: ignore[arg-type]
        run_config=config,
    )
    party = party_from_context(context)
    assert party.scenario.fleet.parties == 5000 and party.partition_id == 4321
    bad = dataclasses.replace(context, run_config={**config, PARTIES_KEY: 0})
    with pytest.raises(PartyConfigError):
        party_from_context(bad)


def test_samples_per_party_is_checked() -> None:
    text = """
name = "x"
[data]
dataset = "inspection"
alpha = 1.0
samples_per_party = -3
[fleet]
parties = 4
per_round = 2
speed_distribution = "lognormal"
lognormal_sigma = 0.5
[device]
seconds_per_example = 0.01
[training]
rounds = 1
lr = 0.1
local_epochs = 1
batch_size = 4
target_accuracy = 0.5
"""
    with pytest.raises(ScenarioError, match="samples_per_party"):
        parse_scenario(text)


def test_the_in_process_grid_makes_a_node_only_when_asked() -> None:
    calls: list[int] = []

    def app(message: Message, context: Context) -> Message:
        calls.append(int(context.node_config["partition-id"]))
        return Message(message.content, reply_to=message)

    from flwr.app import RecordDict
    from flwr.clientapp import ClientApp

    client = ClientApp()
    client.train()(app)
    grid = InProcessGrid(client, 100_000, run_config={"seed": 0})
    try:
        ids = list(grid.get_node_ids())
        assert len(ids) == 100_000 and ids[0] == NODE_ID_BASE
        assert grid._contexts == {}
        message = Message(RecordDict(), dst_node_id=NODE_ID_BASE + 77_777, message_type="train")
        replies = list(grid.send_and_receive([message], timeout=30))
        assert len(replies) == 1 and calls == [77_777]
        assert list(grid._contexts) == [NODE_ID_BASE + 77_777]
        with pytest.raises(ValueError, match="no node"):
            grid.push_messages(
                [Message(RecordDict(), dst_node_id=NODE_ID_BASE + 100_000, message_type="train")]
            )
    finally:
        grid.close()

"""The in-process grid and Flower's simulation runtime give the same run for a seed.

The same strategy drives the same ClientApp on both backends; Flower's runtime gives its
nodes random ids, which :class:`PartitionOrderedGrid` maps back to ``1000 + partition-id``
(checked without Ray on a grid that scrambles the in-process ids, then end to end).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message, MessageType

from fedge.aggregator.fleet.grids import WrappedGrid
from fedge.aggregator.fleet.identity import PartitionOrderedGrid
from fedge.sim.data import make_partitions
from fedge.sim.flower_backend import run_strategies_on_flower, write_app_dir
from fedge.sim.grid import InProcessGrid
from fedge.sim.party_app import app as client_app
from fedge.sim.runner import Curve, drive, run_config, run_one
from fedge.sim.scenario import Scenario, load_scenario

SEED = 3
TINY = """
name = "tiny-backends"
description = "10 parties in 2 speed groups, 3 per round, 4 rounds"

[data]
alpha = 0.5

[fleet]
parties = 10
per_round = 3

[[fleet.groups]]
count = 5
cpus = 4.0
data_share = 0.4

[[fleet.groups]]
count = 5
cpus = 0.5
data_share = 0.6

[device]
seconds_per_example = 0.05
jitter_sigma = 0.1

[training]
rounds = 4
lr = 0.2
local_epochs = 1
batch_size = 10
target_accuracy = 0.9

[strategies.fedavg]

[strategies.tiered]
tiers = 2
profiling_rounds = 1
interval = 2

[strategies.nested]
tiers = 2
profiling_rounds = 1
interval = 2
tier_archs = ["mlp-large", "mlp-large-half"]
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Scenario:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY, encoding="utf-8")
    return load_scenario(str(path))


def assert_same_run(ours: Curve, theirs: Curve) -> None:
    assert [r.selected for r in ours.rounds] == [r.selected for r in theirs.rounds]
    assert [r.on_time for r in ours.rounds] == [r.on_time for r in theirs.rounds]
    assert [r.tier for r in ours.rounds] == [r.tier for r in theirs.rounds]
    np.testing.assert_allclose(ours.accuracy, theirs.accuracy, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours.times_s, theirs.times_s, rtol=0, atol=1e-6)


class ScrambledGrid(WrappedGrid):
    """An in-process grid that shows random node ids, as Flower's runtimes do."""

    def __init__(self, inner: InProcessGrid, seed: int) -> None:
        super().__init__(inner)
        rng = random.Random(seed)
        ids = list(inner.get_node_ids())
        scrambled = rng.sample(range(10**6, 10**7), len(ids))
        rng.shuffle(scrambled)
        self.to_inner = dict(zip(scrambled, ids, strict=True))
        self.from_inner = {v: k for k, v in self.to_inner.items()}
        self.queries = 0

    def get_node_ids(self) -> Iterable[int]:
        return list(self.to_inner)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        batch = list(messages)
        for message in batch:
            self.queries += message.metadata.message_type == MessageType.QUERY
            message.metadata.dst_node_id = self.to_inner[message.metadata.dst_node_id]
        return self.inner.push_messages(batch)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            reply.metadata.__dict__["_src_node_id"] = self.from_inner[reply.metadata.src_node_id]
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        raise NotImplementedError


def test_partition_ordered_grid_restores_partition_ids(scenario: Scenario) -> None:
    data = make_partitions(scenario, SEED)
    config = run_config(scenario, SEED)
    plain = InProcessGrid(client_app, scenario.fleet.parties, run_config=config)
    inner = InProcessGrid(client_app, scenario.fleet.parties, run_config=config)
    scrambled = ScrambledGrid(inner, seed=11)
    ordered = PartitionOrderedGrid(scrambled)
    try:
        expected = drive(scenario, "tiered", SEED, plain, data, None)
        got = drive(scenario, "tiered", SEED, ordered, data, None)
    finally:
        plain.close()
        inner.close()
    assert sorted(ordered.get_node_ids()) == list(range(1000, 1000 + scenario.fleet.parties))
    assert scrambled.queries == scenario.fleet.parties  # each node asked once, ever
    assert ordered.partition_map == {
        shown: scrambled.from_inner[shown] for shown in ordered.partition_map
    }
    assert_same_run(expected, got)
    # Replies name the party as the strategy knows it.
    assert {n for r in got.rounds for n in r.on_time} <= set(ordered.partition_map)


def test_app_dir_carries_the_run_config(tmp_path: Path) -> None:
    from flwr.common.config import get_fused_config_from_dir

    config: dict[str, bool | int | float | str] = {
        "scenario": '/tmp/a "quoted" path.toml',
        "seed": 7,
        "ratio": 0.5,
        "flag": True,
    }
    app_dir = write_app_dir(tmp_path / "app", config)
    assert get_fused_config_from_dir(app_dir, {"seed": 9}) == {**config, "seed": 9}


@pytest.mark.integration
@pytest.mark.xdist_group("ray")  # one Ray at a time (test_ray_cluster.py)
@pytest.mark.timeout(240)
def test_flower_runtime_matches_in_process(scenario: Scenario) -> None:
    strategies = ("fedavg", "tiered", "nested")
    # The strategies in one Flower simulation: Ray starts once.
    flower = run_strategies_on_flower(scenario, strategies, SEED)
    for strategy, theirs in zip(strategies, flower, strict=True):
        ours = run_one(scenario, strategy, SEED)
        assert theirs.strategy == strategy
        assert len(theirs.rounds) == scenario.training.rounds
        assert_same_run(ours, theirs)
        assert theirs.final_accuracy > theirs.accuracy[0]


def test_runner_dispatches_to_the_flower_backend(
    scenario: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fedge.sim.flower_backend as flower_backend

    calls: list[tuple[str, int]] = []

    def fake(scenario: Scenario, strategy_name: str, seed: int, **_: object) -> Curve:
        calls.append((strategy_name, seed))
        return Curve(strategy_name, seed, (0.0,), (0.5,), 0.9, (), 0.0)

    monkeypatch.setattr(flower_backend, "run_on_flower", fake)
    assert run_one(scenario, "tiered", SEED, backend="flower").strategy == "tiered"
    assert calls == [("tiered", SEED)]


def test_converged_accuracy_is_the_mean_over_the_last_tenth_of_the_rounds() -> None:
    accuracy = (0.1, *[0.5] * 18, 0.8, 0.9)  # round 0 + 20 rounds: the tail is 2 rounds
    curve = Curve(
        strategy="s",
        seed=0,
        times_s=tuple(float(t) for t in range(21)),
        accuracy=accuracy,
        target=0.7,
        group_accuracy=(0.5,),
        wall_s=1.0,
    )
    assert curve.final_accuracy == 0.9
    assert curve.converged_accuracy == pytest.approx(0.85)
    short = dataclasses.replace(curve, times_s=(0.0, 1.0), accuracy=(0.1, 0.6))
    assert short.converged_accuracy == pytest.approx(0.6)

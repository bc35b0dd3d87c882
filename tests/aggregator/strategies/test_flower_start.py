"""Flower's own ``Strategy.start`` driving our strategies gives what our loop gives.

``Strategy.start`` calls ``configure_train``, waits for every reply and hands them to
``aggregate_train``; our ``start`` pulls replies as they come. On the virtual clock both
settle a round on the replies' reported times, so for the same seed they must end with the
same models, latency profiles, tiers and tier-selection state (issue 8, "Honour Flower's
contract").
"""

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Strategy

from fedge.aggregator.fleet.grids import NODE_ID_BASE
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.deadline import DeadlineConfig
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.rounds.replies import arrays_of
from fedge.aggregator.strategies.feddf import DistillingTieredFedAvg
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.aggregator.strategies.tiered import TieredFedAvg
from fedge.models import digits
from fedge.sim import runner
from fedge.sim.data import make_partitions
from fedge.sim.grid import InProcessGrid
from fedge.sim.party_app import app as client_app
from fedge.sim.scenario import Scenario, load_scenario

TINY = """
name = "tiny-speeds"
description = "6 parties of 6 speeds: every tier has a faster and a slower party"

[data]
dataset = "digits"
alpha = 0.5
test_fraction = 0.2
proxy_fraction = 0.1

[fleet]
parties = 6
per_round = 2
speed_distribution = "groups"

[[fleet.groups]]
count = 1
cpus = 4.0
data_share = 0.16

[[fleet.groups]]
count = 1
cpus = 3.0
data_share = 0.16

[[fleet.groups]]
count = 1
cpus = 1.0
data_share = 0.17

[[fleet.groups]]
count = 1
cpus = 0.8
data_share = 0.17

[[fleet.groups]]
count = 1
cpus = 0.2
data_share = 0.17

[[fleet.groups]]
count = 1
cpus = 0.1
data_share = 0.17

[device]
seconds_per_example = 0.05
bandwidth_mbps = 10.0
jitter_sigma = 0.0
availability = 1.0
dropout = 0.0

[training]
rounds = 8
lr = 0.2
local_epochs = 1
batch_size = 10
target_accuracy = 0.5
arch = "mlp"
"""


@pytest.fixture
def tiny(tmp_path: Path) -> Scenario:
    path = tmp_path / "tiny-speeds.toml"
    path.write_text(TINY, encoding="utf-8")
    return load_scenario(str(path))


def _tiered(seed: int) -> TieredFedAvg:
    return TieredFedAvg(
        per_round=2,
        seed=seed,
        clock=ClockMode.VIRTUAL,
        n_tiers=3,
        profiling_rounds=1,
        adaptive=True,
        interval=2,  # re-weights tiers by accuracy within the run
        credits_per_tier=4,
        retier_interval=3,
        # A round ends at its first reply: the other party is late, folded a round later.
        deadline=DeadlineConfig(deadline_factor=1.5, quorum_fraction=0.5, late_policy="stale"),
    )


def _both_ways(
    scenario: Scenario,
    make: Callable[[], StreamingFedAvg],
    rounds: int,
    arch: str,
) -> list[tuple[StreamingFedAvg, ArrayRecord, list[RoundRecord]]]:
    """Run ``make()`` under our ``start`` and under Flower's, each on a fresh grid."""
    runs = []
    for drive in ("ours", "flower"):
        strategy = make()
        records: list[RoundRecord] = []
        strategy.observers.append(records.append)
        grid = InProcessGrid(client_app, 6, run_config=runner.run_config(scenario, 0), workers=2)
        initial = digits.to_arrays(digits.make_model(arch, seed=0))
        train_config = runner.train_config(scenario, {"arch": arch})
        try:
            if drive == "ours":
                result = strategy.start(
                    grid, initial, num_rounds=rounds, timeout=60, train_config=train_config
                )
            else:
                result = Strategy.start(
                    strategy,
                    grid,
                    initial,
                    num_rounds=rounds,
                    timeout=60,
                    train_config=train_config,
                )
        finally:
            grid.close()
        runs.append((strategy, result.arrays, records))
    return runs


def _assert_same_rounds(ours: list[RoundRecord], flower: list[RoundRecord]) -> None:
    assert [r.server_round for r in flower] == [r.server_round for r in ours]
    for mine, theirs in zip(ours, flower, strict=True):
        assert (theirs.tier, theirs.selected, theirs.on_time, theirs.late, theirs.failed) == (
            mine.tier,
            mine.selected,
            mine.on_time,
            mine.late,
            mine.failed,
        )
        assert (theirs.stale_folded, theirs.quorum_met) == (mine.stale_folded, mine.quorum_met)
        assert theirs.round_time_s == pytest.approx(mine.round_time_s)
        # train-time-s is the party's real (wall) compute time: it differs run to run.
        assert _deterministic(theirs.train_metrics) == pytest.approx(
            _deterministic(mine.train_metrics)
        )


def _deterministic(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k != "train-time-s"}


def _assert_same_arrays(ours: ArrayRecord, flower: ArrayRecord) -> None:
    mine, theirs = arrays_of(ours), arrays_of(flower)
    assert mine.keys() == theirs.keys()
    for key in mine:
        np.testing.assert_allclose(theirs[key], mine[key], rtol=1e-6, atol=1e-7)


def test_flower_start_on_tiered_fedavg_gives_our_models_and_tier_updates(tiny: Scenario) -> None:
    (ours, our_arrays, our_rounds), (flower, flower_arrays, flower_rounds) = _both_ways(
        tiny, lambda: _tiered(seed=0), rounds=8, arch="mlp"
    )
    assert isinstance(ours, TieredFedAvg) and isinstance(flower, TieredFedAvg)
    # The run exercised what aggregate_train must reproduce: tiers, late and stale folds.
    assert all(r.tier is not None for r in our_rounds[1:])
    assert any(r.late for r in our_rounds) and any(r.stale_folded for r in our_rounds)
    assert ours.selection is not None and any(ours.selection.accuracy_history)
    assert ours.selection.last_change_round is not None  # Algorithm 2 re-weighted the tiers
    _assert_same_rounds(our_rounds, flower_rounds)
    _assert_same_arrays(our_arrays, flower_arrays)
    # Tier updates: the same tiers, accuracies, credits, probabilities, latency profiles.
    assert flower.tiers == ours.tiers
    assert flower.selection is not None
    assert flower.selection.credits == ours.selection.credits
    assert flower.selection.accuracy_rounds == ours.selection.accuracy_rounds
    assert flower.selection.last_change_round == ours.selection.last_change_round
    assert flower.selection.probabilities == pytest.approx(ours.selection.probabilities)
    for mine, theirs in zip(
        ours.selection.accuracy_history, flower.selection.accuracy_history, strict=True
    ):
        assert theirs == pytest.approx(mine)
    assert flower.profiles.keys() == ours.profiles.keys()
    for node, profile in ours.profiles.items():
        assert flower.profiles[node].mean_s == pytest.approx(profile.mean_s)
        assert (flower.profiles[node].count, flower.profiles[node].timeouts) == (
            profile.count,
            profile.timeouts,
        )
    assert flower.elapsed_s == pytest.approx(ours.elapsed_s)
    assert len(flower.late_replies()) == len(ours.late_replies())


def test_flower_start_on_the_distill_strategy_gives_our_models(tiny: Scenario) -> None:
    proxy = make_partitions(tiny, 0).proxy_X

    def distill() -> DistillingTieredFedAvg:
        return DistillingTieredFedAvg(
            per_round=2,
            seed=0,
            clock=ClockMode.VIRTUAL,
            n_tiers=3,
            profiling_rounds=1,
            adaptive=False,
            static_probabilities=[0.2, 0.2, 0.6],
            tier_archs=["mlp-large", "mlp", "mlp-small"],
            distill_epochs=1,
            proxy_X=proxy,
        )

    (ours, our_arrays, our_rounds), (flower, flower_arrays, flower_rounds) = _both_ways(
        tiny, distill, rounds=4, arch="mlp-large"
    )
    assert isinstance(ours, DistillingTieredFedAvg) and isinstance(flower, DistillingTieredFedAvg)
    assert len(ours.trained) >= 2, "one architecture trained: pick another seed"
    _assert_same_rounds(our_rounds, flower_rounds)
    _assert_same_arrays(our_arrays, flower_arrays)
    assert flower.trained == ours.trained
    for arch, model in ours.models.items():
        _assert_same_arrays(model, flower.models[arch])
    assert flower.selection == ours.selection


def test_under_flower_start_failed_and_malformed_replies_are_failed_parties() -> None:
    """The same refusals as our loop (test_strategies): the honest echo alone is folded."""
    liar = ClientApp()

    @liar.train()
    def _reply(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if partition == 4:
            raise RuntimeError("camera unplugged")
        arrays = msg.content.array_records["arrays"]
        weight: float = 2
        if partition == 0:
            weight = float("inf")
        elif partition == 1:
            weight = -5
        elif partition == 2:
            arrays = ArrayRecord({"w": Array(np.ones((7, 7), np.float32))})
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": weight})})
        return Message(content=content, reply_to=msg)

    grid = InProcessGrid(liar, 5)
    strategy = StreamingFedAvg(per_round=5, seed=0, clock=ClockMode.WALL, fraction_evaluate=0.0)
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    initial = ArrayRecord(array_dict={"w": Array(np.zeros(4, dtype=np.float32))})
    try:
        result = Strategy.start(strategy, grid, initial, num_rounds=1, timeout=30)
    finally:
        grid.close()
    (record,) = records
    assert set(record.failed) == {NODE_ID_BASE + p for p in (0, 1, 2, 4)}
    assert all("malformed reply" in record.failures[NODE_ID_BASE + p] for p in (0, 1, 2))
    assert "camera unplugged" in record.failures[NODE_ID_BASE + 4]
    assert record.on_time == (NODE_ID_BASE + 3,)
    np.testing.assert_allclose(result.arrays["w"].numpy(), initial["w"].numpy())
    # Every party was profiled, failed ones charged the round's length (TiFL's T_max).
    assert set(strategy.profiles) == {NODE_ID_BASE + p for p in range(5)}
    assert strategy.profiles[NODE_ID_BASE].timeouts == 1


def test_aggregate_train_needs_its_round_configured() -> None:
    strategy = StreamingFedAvg(per_round=1, seed=0)
    with pytest.raises(ValueError, match="configure_train"):
        strategy.aggregate_train(1, [])

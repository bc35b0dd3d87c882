"""FedDF-style distillation across per-tier architectures (DistillingTieredFedAvg)."""

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TIERED_FLEET, RecordingGrid
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedge.aggregator.fleet.grids import NODE_ID_BASE
from fedge.aggregator.jobs.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    restore_strategy,
    save_checkpoint,
)
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.rounds.replies import arrays_of
from fedge.aggregator.strategies import ensemble
from fedge.aggregator.strategies.factory import StrategyConfigError, build_strategy
from fedge.aggregator.strategies.feddf import DistillingTieredFedAvg
from fedge.models import digits
from fedge.sim import runner
from fedge.sim.data import make_partitions
from fedge.sim.grid import InProcessGrid
from fedge.sim.party_app import app as client_app
from fedge.sim.scenario import Scenario, load_scenario

TINY = (
    """
name = "tiny-mixed"
description = "6 parties in 3 speed groups, one architecture per tier"
"""
    + TIERED_FLEET
    + """

[strategies.fedavg-large]
kind = "fedavg"
arch = "mlp-large"

[strategies.distill]
tiers = 3
profiling_rounds = 1
adaptive = false
static_probabilities = [0.2, 0.2, 0.6]
tier_archs = ["mlp-large", "mlp", "mlp-small"]
distill_epochs = 2
"""
)


@pytest.fixture
def tiny(tmp_path: Path) -> Scenario:
    path = tmp_path / "tiny-mixed.toml"
    path.write_text(TINY, encoding="utf-8")
    return load_scenario(str(path))


def _distill(
    scenario: Scenario, seed: int = 0, clock: ClockMode = ClockMode.VIRTUAL
) -> DistillingTieredFedAvg:
    strategy, _ = build_strategy(
        "distill",
        scenario.strategy("distill"),
        per_round=scenario.fleet.per_round,
        seed=seed,
        clock=clock,
        proxy_X=make_partitions(scenario, seed).proxy_X,
    )
    assert isinstance(strategy, DistillingTieredFedAvg)
    return strategy


# ---------------------------------------------------------------- the distillation itself


def test_every_architecture_moves_towards_the_ensemble_of_the_teachers() -> None:
    proxy = np.random.default_rng(0).random((96, digits.N_FEATURES)).astype(np.float32)
    models = {
        arch: digits.to_arrays(digits.make_model(arch, seed=i))
        for i, arch in enumerate(("mlp-large", "mlp", "mlp-small"))
    }
    settings = ensemble.DistillSettings(temperature=2.0, epochs=20, lr=1e-2, batch_size=16)
    out, losses = ensemble.distill_into_each(
        models, proxy, settings, teachers={"mlp-large", "mlp"}, seed=0
    )
    before, after = losses["mlp-small"]  # not a teacher: it learns the most
    assert before > 0 and after < 0.5 * before
    # The target is the mean logits of the teachers as they were before the round.
    X = torch.tensor(proxy)
    members = [digits.make_model(a) for a in ("mlp-large", "mlp")]
    for model, arch in zip(members, ("mlp-large", "mlp"), strict=True):
        digits.load_arrays(model, models[arch])
    target = torch.stack([m(X) for m in members]).mean(dim=0).detach()
    student = digits.make_model("mlp-small")
    digits.load_arrays(student, out["mlp-small"])
    assert after == pytest.approx(ensemble.divergence(student, target, X, 2.0), rel=1e-5)
    # Seeded: the same call gives the same models.
    again, _ = ensemble.distill_into_each(
        models, proxy, settings, teachers={"mlp-large", "mlp"}, seed=0
    )
    for arch in models:
        for key, value in arrays_of(out[arch]).items():
            np.testing.assert_array_equal(arrays_of(again[arch])[key], value)


def test_distill_into_each_reduces_every_architecture_divergence() -> None:
    proxy = np.random.default_rng(1).random((64, digits.N_FEATURES)).astype(np.float32)
    models = {
        arch: digits.to_arrays(digits.make_model(arch, seed=i))
        for i, arch in enumerate(("mlp-large", "mlp", "mlp-small"))
    }
    settings = ensemble.DistillSettings(epochs=10, lr=1e-2, batch_size=16)
    out, losses = ensemble.distill_into_each(models, proxy, settings, seed=0)
    assert set(out) == set(models)
    for arch, (before, after) in losses.items():
        assert after < before, arch
        digits.load_arrays(digits.make_model(arch), out[arch])  # still that architecture


def test_proxy_split_holds_out_a_stable_disjoint_share() -> None:
    split = ensemble.split_proxy(144, 0.2, seed=3)
    assert len(split.validation) == 29 and len(split.train) == 115
    assert set(split.train.tolist()).isdisjoint(split.validation.tolist())
    assert sorted([*split.train.tolist(), *split.validation.tolist()]) == list(range(144))
    again = ensemble.split_proxy(144, 0.2, seed=3)
    np.testing.assert_array_equal(again.validation, split.validation)
    assert not np.array_equal(ensemble.split_proxy(144, 0.2, seed=4).validation, split.validation)
    assert ensemble.split_proxy(10, 0.0, seed=0).validation.size == 0
    assert len(ensemble.split_proxy(2, 0.9, seed=0).train) == 1  # one is always left to train
    with pytest.raises(ValueError, match="at least 2 proxy samples"):
        ensemble.split_proxy(1, 0.2, seed=0)


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [("validation_fraction", 1.0, "distill_validation"), ("patience", 0, "distill_patience")],
)
def test_bad_early_stopping_settings_are_refused(field: str, value: float, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ensemble.DistillSettings(**{field: value})  # type: ignore[arg-type]


def test_early_stopping_keeps_the_best_held_out_epoch_and_never_ends_worse() -> None:
    proxy = np.random.default_rng(2).random((80, digits.N_FEATURES)).astype(np.float32)
    models = {
        arch: digits.to_arrays(digits.make_model(arch, seed=i))
        for i, arch in enumerate(("mlp-large", "mlp", "mlp-small"))
    }
    split = ensemble.split_proxy(len(proxy), 0.25, seed=0)
    settings = ensemble.DistillSettings(
        epochs=40, lr=1e-2, batch_size=16, validation_fraction=0.25, patience=3
    )
    out, losses = ensemble.distill_into_each(models, proxy, settings, seed=0, split=split)
    # The losses are on the held-out samples: recompute "after" there from the result.
    X = torch.tensor(proxy)
    members = []
    for arch in models:
        member = digits.make_model(arch)
        digits.load_arrays(member, models[arch])
        members.append(member)
    target = torch.stack([m(X) for m in members]).mean(dim=0).detach()
    held = torch.from_numpy(split.validation)
    for arch, (before, after) in losses.items():
        assert after < before, arch  # random models: distillation helps every one
        student = digits.make_model(arch)
        digits.load_arrays(student, out[arch])
        assert after == pytest.approx(
            ensemble.divergence(student, target[held], X[held], 1.0), rel=1e-5
        )


def test_a_model_already_equal_to_the_ensemble_is_left_as_it_was() -> None:
    # The only teacher is the model itself: epoch 0 (divergence 0) is the best, so early
    # stopping returns the within-architecture average untouched instead of Adam's drift.
    proxy = np.random.default_rng(3).random((40, digits.N_FEATURES)).astype(np.float32)
    models = {"mlp": digits.to_arrays(digits.make_model("mlp", seed=5))}
    settings = ensemble.DistillSettings(epochs=5, lr=1e-2, validation_fraction=0.2, patience=2)
    split = ensemble.split_proxy(len(proxy), 0.2, seed=1)
    out, losses = ensemble.distill_into_each(models, proxy, settings, seed=0, split=split)
    assert losses["mlp"] == (0.0, 0.0)
    for key, value in arrays_of(models["mlp"]).items():
        np.testing.assert_array_equal(arrays_of(out["mlp"])[key], value)


def test_the_strategy_takes_early_stopping_from_its_table(tiny: Scenario) -> None:
    params = {**tiny.strategy("distill"), "distill_validation": 0.25, "distill_patience": 2}
    proxy = make_partitions(tiny, 0).proxy_X
    strategy, _ = build_strategy(
        "distill", params, per_round=2, seed=0, clock=ClockMode.VIRTUAL, proxy_X=proxy
    )
    assert isinstance(strategy, DistillingTieredFedAvg)
    assert strategy.distill_settings.validation_fraction == 0.25
    assert strategy.distill_settings.patience == 2
    assert len(strategy.proxy_split.validation) == round(0.25 * len(proxy))
    with pytest.raises(StrategyConfigError, match="distill_validation"):
        build_strategy(
            "distill",
            {**params, "distill_validation": 1.5},
            per_round=2,
            seed=0,
            clock=ClockMode.VIRTUAL,
            proxy_X=proxy,
        )


# ---------------------------------------------------------------- the strategy


def test_parties_of_a_slow_tier_receive_the_small_architecture(tiny: Scenario) -> None:
    strategy = _distill(tiny)
    grid = RecordingGrid(client_app, 6, run_config=runner.run_config(tiny, 0), workers=2)
    rounds: list[int] = []
    strategy.observers.append(lambda record: rounds.append(record.server_round))
    try:
        strategy.start(
            grid,
            digits.to_arrays(digits.make_model("mlp-large", seed=0)),
            num_rounds=6,
            timeout=60,
            train_config=runner.train_config(tiny, {}),
        )
    finally:
        grid.close()
    assert rounds == [1, 2, 3, 4, 5, 6]
    assert strategy.tiers is not None
    slow = set(strategy.tiers.members[2])
    # Tiers follow the device groups: the 0.1-CPU parties are partitions 4 and 5.
    assert slow == {NODE_ID_BASE + 4, NODE_ID_BASE + 5}
    by_round: dict[int, list[Message]] = {}
    for message in grid.pushed:
        sent = message.content.config_records["config"]
        by_round.setdefault(int(sent["server-round"]), []).append(message)  # type: ignore[arg-type]
    # Profiling: everyone, largest architecture.
    assert len(by_round[1]) == 6
    seen_slow = False
    for server_round, messages in by_round.items():
        for message in messages:
            config: ConfigRecord = message.content.config_records["config"]
            arrays: ArrayRecord = message.content.array_records["arrays"]
            arch = str(config["arch"])
            digits.load_arrays(digits.make_model(arch), arrays)  # arrays match the arch
            node = message.metadata.dst_node_id
            if server_round == 1:
                assert arch == "mlp-large"
            elif node in slow:
                assert arch == "mlp-small"
                seen_slow = True
            else:
                assert arch == ("mlp-large" if node in strategy.tiers.members[0] else "mlp")
    assert seen_slow, "the slow tier was never selected: pick another seed"
    assert set(strategy.models) == {"mlp-large", "mlp", "mlp-small"}
    assert "mlp-small" in strategy.trained


@pytest.mark.slow
def test_a_mixed_run_completes_and_records_accuracy(tiny: Scenario) -> None:
    curve = runner.run_one(tiny, "distill", seed=0)
    assert len(curve.accuracy) == tiny.training.rounds + 1
    assert all(0.0 <= a <= 1.0 for a in curve.accuracy)
    assert curve.final_accuracy > 0.3  # well above chance (0.1) after 10 rounds
    assert curve.times_s[-1] > 0
    distilled = [r.train_metrics for r in curve.rounds if "distill-kl-after/mlp" in r.train_metrics]
    assert distilled, "no round distilled"
    # A smaller arch costs less virtual compute: the slow tier trained mlp-large in the
    # profiling round (which it dominates) and mlp-small afterwards.
    slow_rounds = [r for r in curve.rounds[1:] if r.tier == 2]
    assert slow_rounds
    assert max(r.round_time_s for r in slow_rounds) < curve.rounds[0].round_time_s / 5


def test_fedavg_arch_param_trains_and_evaluates_that_arch(tiny: Scenario) -> None:
    _, extra = build_strategy(
        "fedavg-large",
        tiny.strategy("fedavg-large"),
        per_round=2,
        seed=0,
        clock=ClockMode.VIRTUAL,
    )
    assert extra == {"arch": "mlp-large"}
    with pytest.raises(StrategyConfigError, match="arch: unknown architecture 'nope'"):
        build_strategy(
            "f", {"kind": "fedavg", "arch": "nope"}, per_round=2, seed=0, clock=ClockMode.VIRTUAL
        )


def _run(
    strategy: DistillingTieredFedAvg,
    scenario: Scenario,
    initial: ArrayRecord,
    rounds: int,
    *,
    first_round: int = 1,
    checkpoint_fn: Callable[[int, ArrayRecord], None] | None = None,
) -> ArrayRecord:
    grid = InProcessGrid(client_app, 6, run_config=runner.run_config(scenario, 0), workers=2)
    try:
        result = strategy.start(
            grid,
            initial,
            num_rounds=rounds,
            timeout=60,
            train_config=runner.train_config(scenario, {}),
            first_round=first_round,
            checkpoint_fn=checkpoint_fn,
        )
    finally:
        grid.close()
    return result.arrays


def test_on_the_wall_clock_replies_fold_per_architecture_as_they_arrive(tiny: Scenario) -> None:
    strategy = _distill(tiny, clock=ClockMode.WALL)
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    initial = digits.to_arrays(digits.make_model("mlp-large", seed=0))
    final = _run(strategy, tiny, initial, 5)
    assert [r.server_round for r in records] == [1, 2, 3, 4, 5]
    assert all(r.quorum_met for r in records)
    # Tiers come from measured wall latencies, so which tier trains when is not fixed;
    # every round still distils into every architecture that exists.
    assert len(strategy.trained) >= 2
    for record in records[1:]:
        assert {f"distill-kl-after/{a}" for a in strategy.models} <= set(record.train_metrics)
    digits.load_arrays(digits.make_model("mlp-large"), final)
    assert not np.array_equal(arrays_of(final)["0.weight"], arrays_of(initial)["0.weight"])


def test_a_resumed_run_restores_every_architecture_and_ends_identically(
    tiny: Scenario, tmp_path: Path
) -> None:
    initial = digits.to_arrays(digits.make_model("mlp-large", seed=0))
    straight = _run(_distill(tiny), tiny, initial, 5)

    first = _distill(tiny)

    def checkpoint(server_round: int, arrays: ArrayRecord) -> None:
        save_checkpoint(tmp_path, server_round, arrays, first)

    _run(first, tiny, initial, 3, checkpoint_fn=checkpoint)
    saved = latest_checkpoint(tmp_path)
    assert saved is not None and saved.round == 3
    assert set(saved.extra) == {"mlp-large", "mlp", "mlp-small"}

    resumed = _distill(tiny)
    restore_strategy(resumed, saved)
    assert resumed.trained == first.trained
    for arch, record in first.models.items():
        for key, value in arrays_of(record).items():
            np.testing.assert_array_equal(arrays_of(resumed.models[arch])[key], value)
    final = _run(resumed, tiny, saved.array_record(), 5, first_round=4)
    for key, value in arrays_of(straight).items():
        np.testing.assert_allclose(arrays_of(final)[key], value, rtol=0, atol=1e-6)


def test_a_checkpoint_with_models_of_other_architectures_is_refused(
    tiny: Scenario, tmp_path: Path
) -> None:
    strategy = _distill(tiny)
    strategy.models = {"mlp-tiny": digits.to_arrays(digits.make_model("mlp-small"))}
    save_checkpoint(tmp_path, 1, digits.to_arrays(digits.make_model("mlp-large")), strategy)
    saved = latest_checkpoint(tmp_path)
    assert saved is not None
    with pytest.raises(CheckpointError, match="mlp-tiny"):
        restore_strategy(_distill(tiny), saved)


# ---------------------------------------------------------------- refused up front


@pytest.mark.parametrize(
    ("proxy", "problem"),
    [
        (np.zeros((0, digits.N_FEATURES), dtype=np.float32), "empty"),
        (np.zeros((5, 8), dtype=np.float32), "8 features per sample, the models take 64"),
        (np.zeros(64, dtype=np.float32), r"2-D \[samples, 64\]"),
        (np.zeros((5, digits.N_FEATURES), dtype=np.int64), "floats"),
        (np.full((5, digits.N_FEATURES), np.nan, dtype=np.float32), "NaN"),
        ([[0.0] * 64], "numpy array"),
    ],
)
def test_bad_proxy_is_refused_before_any_round(tiny: Scenario, proxy: object, problem: str) -> None:
    with pytest.raises(StrategyConfigError, match=problem):
        build_strategy(
            "distill",
            tiny.strategy("distill"),
            per_round=2,
            seed=0,
            clock=ClockMode.VIRTUAL,
            proxy_X=proxy,  # type: ignore[arg-type]
        )
    with pytest.raises(ensemble.ProxyError, match=problem):
        DistillingTieredFedAvg(
            proxy_X=proxy,  # type: ignore[arg-type]
            tier_archs=["mlp-large", "mlp", "mlp-small"],
            n_tiers=3,
            per_round=2,
            clock=ClockMode.VIRTUAL,
        )


def test_distill_without_proxy_or_with_bad_archs_is_refused(tiny: Scenario) -> None:
    params = tiny.strategy("distill")
    with pytest.raises(StrategyConfigError, match="proxy_X"):
        build_strategy("distill", params, per_round=2, seed=0, clock=ClockMode.VIRTUAL)
    proxy = np.zeros((4, digits.N_FEATURES), dtype=np.float32)
    with pytest.raises(StrategyConfigError, match="one architecture per tier"):
        build_strategy(
            "distill",
            {**params, "tier_archs": ["mlp", "mlp-small"]},
            per_round=2,
            seed=0,
            clock=ClockMode.VIRTUAL,
            proxy_X=proxy,
        )
    with pytest.raises(StrategyConfigError, match="unknown architecture"):
        build_strategy(
            "distill",
            {**params, "tier_archs": ["mlp", "mlp", "cnn"]},
            per_round=2,
            seed=0,
            clock=ClockMode.VIRTUAL,
            proxy_X=proxy,
        )


def test_late_replies_are_folded_into_their_own_architecture_later(tiny: Scenario) -> None:
    params = {
        **tiny.strategy("distill"),
        "deadline_factor": 0.8,  # below the tier's p90 latency: someone is late
        "quorum_fraction": 0.5,
        "late_policy": "stale",
    }
    strategy, _ = build_strategy(
        "distill",
        params,
        per_round=tiny.fleet.per_round,
        seed=0,
        clock=ClockMode.VIRTUAL,
        proxy_X=make_partitions(tiny, 0).proxy_X,
    )
    assert isinstance(strategy, DistillingTieredFedAvg)
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    initial = digits.to_arrays(digits.make_model("mlp-large", seed=0))
    _run(strategy, tiny, initial, 8)
    late_rounds = [r for r in records if r.late]
    assert late_rounds, "no party was late: lower deadline_factor"
    # A late reply is folded one round later, into the mean of the architecture it trained
    # (folding it into another architecture's mean would fail on the array shapes).
    folded = [r for r in records if r.stale_folded]
    assert folded and folded[0].server_round == late_rounds[0].server_round + 1
    late_archs = {strategy.arch_of(node, r.server_round) for r in late_rounds for node in r.late}
    on_time_archs = {strategy.arch_of(node, folded[0].server_round) for node in folded[0].on_time}
    # Seed 0: mlp-large parties were late and the next round trained mlp-small, so that
    # round aggregated two architectures at once, each from its own replies.
    assert late_archs == {"mlp-large"} and on_time_archs == {"mlp-small"}
    assert {"distill-kl-after/mlp-large", "distill-kl-after/mlp-small"} <= set(
        folded[0].train_metrics
    )
    for arch, record in strategy.models.items():
        digits.load_arrays(digits.make_model(arch), record)

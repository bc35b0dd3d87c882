"""HeteroFL's nested sub-models across TiFL tiers (NestedTieredFedAvg)."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TIERED_FLEET, RecordingGrid
from flwr.app import ArrayRecord, ConfigRecord

from fedge.aggregator.fleet.grids import NODE_ID_BASE
from fedge.aggregator.jobs.checkpoint import latest_checkpoint, restore_strategy, save_checkpoint
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.rounds.replies import arrays_of, to_array_record
from fedge.aggregator.strategies.factory import StrategyConfigError, build_strategy
from fedge.aggregator.strategies.nested import (
    NestedTieredFedAvg,
    NestingError,
    check_nested,
    nested_mean,
    sub_model,
)
from fedge.models import digits
from fedge.models.inspection import InspectionNet
from fedge.sim import runner
from fedge.sim.grid import InProcessGrid
from fedge.sim.party_app import app as client_app
from fedge.sim.scenario import Scenario, load_scenario
from fedge.sim.server_app import ServerSettings

TINY = (
    """
name = "tiny-nested"
description = "6 parties in 3 speed groups, the slowest on a slice of the global model"
"""
    + TIERED_FLEET
    + """

[strategies.nested]
tiers = 3
profiling_rounds = 1
adaptive = false
static_probabilities = [0.2, 0.2, 0.6]
tier_archs = ["mlp-large", "mlp-large", "mlp-large-half"]
"""
)

LARGE, HALF = "mlp-large", "mlp-large-half"


@pytest.fixture
def tiny(tmp_path: Path) -> Scenario:
    path = tmp_path / "tiny-nested.toml"
    path.write_text(TINY, encoding="utf-8")
    return load_scenario(str(path))


def _shapes(model: Any) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _nested(scenario: Scenario, **extra: object) -> NestedTieredFedAvg:
    strategy, config = build_strategy(
        "nested",
        {**scenario.strategy("nested"), **extra},
        per_round=scenario.fleet.per_round,
        seed=0,
        clock=ClockMode.VIRTUAL,
    )
    assert isinstance(strategy, NestedTieredFedAvg)
    assert config == {"arch": LARGE}  # the global (evaluated) model is the largest
    return strategy


# ---------------------------------------------------------------- the arithmetic


def test_half_width_mlp_and_narrower_inspection_cnns_nest_in_the_largest() -> None:
    large = _shapes(digits.make_model(LARGE))
    check_nested(_shapes(digits.make_model(HALF)), large)
    check_nested(large, large)
    # The fleet's inspection CNN at its three widths (party/families.py) nests as well.
    cnn = _shapes(InspectionNet(width=16))
    for width in (8, 4):
        check_nested(_shapes(InspectionNet(width=width)), cnn)


def test_architectures_that_do_not_nest_are_named() -> None:
    large = _shapes(digits.make_model(LARGE))
    missing = r"'mlp' is not a slice.*missing \['4\.bias', '4\.weight'\]"
    with pytest.raises(NestingError, match=missing):
        check_nested(_shapes(digits.make_model("mlp")), large, name="'mlp'")
    with pytest.raises(NestingError, match=r"0.weight is \[256, 64\], the global model's \[128"):
        check_nested(large, _shapes(digits.make_model(HALF)))
    with pytest.raises(NestingError, match=r"0\.weight is \[4\]"):
        check_nested({"0.weight": (4,)}, {"0.weight": (4, 4)})  # another rank


def test_a_sub_model_is_a_copy_of_the_leading_slices() -> None:
    global_arrays = arrays_of(digits.to_arrays(digits.make_model(LARGE, seed=3)))
    half = sub_model(global_arrays, _shapes(digits.make_model(HALF)))
    np.testing.assert_array_equal(half["0.weight"], global_arrays["0.weight"][:128, :])
    np.testing.assert_array_equal(half["2.weight"], global_arrays["2.weight"][:64, :128])
    np.testing.assert_array_equal(half["4.weight"], global_arrays["4.weight"][:, :64])
    np.testing.assert_array_equal(half["4.bias"], global_arrays["4.bias"])
    before = half["0.weight"].copy()
    global_arrays["0.weight"][:] = 7.0
    np.testing.assert_array_equal(half["0.weight"], before)  # not a view
    # It loads into the half-width network: the sub-model is that architecture.
    digits.load_arrays(digits.make_model(HALF), to_array_record(half))


def test_each_parameter_is_averaged_over_the_means_that_hold_it() -> None:
    current = {"w": np.full((3, 3), 9.0, dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}
    full = {"w": np.ones((3, 3), dtype=np.float32), "b": np.ones(3, dtype=np.float32)}
    half = {"w": np.full((2, 2), 4.0, dtype=np.float32), "b": np.full(2, 4.0, dtype=np.float32)}
    both = nested_mean(current, [(full, 1.0), (half, 3.0)])
    expected = np.ones((3, 3))
    expected[:2, :2] = (1.0 * 1 + 3.0 * 4) / 4  # 3.25 where both hold the parameter
    np.testing.assert_array_equal(both["w"], expected)
    np.testing.assert_array_equal(both["b"], [3.25, 3.25, 1.0])
    assert both["w"].dtype == np.float32
    # A round of the slice alone leaves what it does not hold as it was.
    alone = nested_mean(current, [(half, 3.0)])
    np.testing.assert_array_equal(alone["w"][:2, :2], np.full((2, 2), 4.0))
    np.testing.assert_array_equal(alone["w"][2, :], [9.0, 9.0, 9.0])
    np.testing.assert_array_equal(alone["w"][:, 2], [9.0, 9.0, 9.0])
    # The full model alone is FedAvg's mean; no mean at all (or no weight) changes nothing.
    np.testing.assert_array_equal(nested_mean(current, [(full, 2.0)])["w"], full["w"])
    np.testing.assert_array_equal(nested_mean(current, [(half, 0.0)])["w"], current["w"])


def test_the_nested_mean_equals_averaging_every_reply_zero_padded() -> None:
    """Per parameter, the weighted mean of the per-architecture means equals the weighted
    mean over the individual replies that hold it (folding per architecture first loses
    nothing)."""
    rng = np.random.default_rng(0)
    current = {"w": rng.normal(size=(6, 5)).astype(np.float32)}
    replies = [
        ({"w": rng.normal(size=shape).astype(np.float32)}, float(weight))
        for shape, weight in [((6, 5), 3), ((6, 5), 1), ((3, 2), 5), ((3, 2), 2)]
    ]
    means = []
    for shape in ((6, 5), (3, 2)):
        fold = StreamingMean()
        for arrays, w in replies:
            if arrays["w"].shape == shape:
                fold.add(arrays, w)
        means.append((fold.result(), fold.total_weight))
    got = nested_mean(current, means)["w"]
    total, held = np.zeros((6, 5)), np.zeros((6, 5))
    for arrays, w in replies:
        rows, cols = arrays["w"].shape
        total[:rows, :cols] += w * arrays["w"]
        held[:rows, :cols] += w
    np.testing.assert_allclose(got, total / held, rtol=1e-6)


# ---------------------------------------------------------------- the strategy


def test_slow_parties_train_a_slice_and_only_that_slice_moves(tiny: Scenario) -> None:
    strategy = _nested(tiny)
    rounds: dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray], set[str]]] = {}
    aggregate = strategy.aggregate

    def recording(
        server_round: int,
        arrays: ArrayRecord,
        folds: dict[str, StreamingMean],
        metrics: dict[str, float],
    ) -> ArrayRecord:
        groups = {g for g, fold in folds.items() if fold.count}
        new = aggregate(server_round, arrays, folds, metrics)
        rounds[server_round] = (arrays_of(arrays), arrays_of(new), groups)
        return new

    strategy.aggregate = recording  # type: ignore[method-assign]
    grid = RecordingGrid(client_app, 6, run_config=runner.run_config(tiny, 0), workers=2)
    try:
        strategy.start(
            grid,
            digits.to_arrays(digits.make_model(LARGE, seed=0)),
            num_rounds=8,
            timeout=60,
            train_config=runner.train_config(tiny, {}),
        )
    finally:
        grid.close()
    assert strategy.tiers is not None
    slow = set(strategy.tiers.members[2])
    assert slow == {NODE_ID_BASE + 4, NODE_ID_BASE + 5}  # the 0.1-CPU parties
    for message in grid.pushed:
        config: ConfigRecord = message.content.config_records["config"]
        sent = arrays_of(message.content.array_records["arrays"])
        server_round = int(config["server-round"])  # type: ignore[arg-type]
        node = message.metadata.dst_node_id
        arch = str(config["arch"])
        assert arch == (HALF if server_round > 1 and node in slow else LARGE)
        # What a slow party gets is the global model of that round, cut to its slice.
        global_then = rounds[server_round][0]
        for key, value in sent.items():
            np.testing.assert_array_equal(value, global_then[key][tuple(map(slice, value.shape))])
    slice_rounds = [r for r, (_, _, groups) in rounds.items() if groups == {HALF}]
    assert slice_rounds, "the slow tier was never drawn alone: pick another seed"
    half = _shapes(digits.make_model(HALF))
    for server_round in slice_rounds:
        before, after, _ = rounds[server_round]
        for key, shape in half.items():
            inside = tuple(map(slice, shape))
            assert not np.array_equal(after[key][inside], before[key][inside]), key
            outside = np.ones(before[key].shape, dtype=bool)
            outside[inside] = False
            np.testing.assert_array_equal(after[key][outside], before[key][outside])


def test_a_resumed_run_ends_as_the_straight_one(tiny: Scenario, tmp_path: Path) -> None:
    initial = digits.to_arrays(digits.make_model(LARGE, seed=0))

    def run(strategy: NestedTieredFedAvg, arrays: ArrayRecord, rounds: int, **kw: Any) -> Any:
        grid = InProcessGrid(client_app, 6, run_config=runner.run_config(tiny, 0), workers=2)
        try:
            return strategy.start(
                grid,
                arrays,
                num_rounds=rounds,
                timeout=60,
                train_config=runner.train_config(tiny, {}),
                **kw,
            ).arrays
        finally:
            grid.close()

    straight = run(_nested(tiny), initial, 6)
    first = _nested(tiny)
    run(
        first,
        initial,
        3,
        checkpoint_fn=lambda r, a: save_checkpoint(tmp_path, r, a, first),
    )
    saved = latest_checkpoint(tmp_path)
    assert saved is not None and saved.round == 3
    resumed = _nested(tiny)
    restore_strategy(resumed, saved)
    final = run(resumed, saved.array_record(), 6, first_round=4)
    for key, value in arrays_of(straight).items():
        np.testing.assert_allclose(arrays_of(final)[key], value, rtol=0, atol=1e-6)


def test_late_slices_are_folded_with_their_own_architecture(tiny: Scenario) -> None:
    strategy = _nested(
        tiny,
        deadline_factor=0.8,  # below the tier's p90 latency: someone is late
        quorum_fraction=0.5,
        late_policy="stale",
    )
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    grid = InProcessGrid(client_app, 6, run_config=runner.run_config(tiny, 0), workers=2)
    try:
        final = strategy.start(
            grid,
            digits.to_arrays(digits.make_model(LARGE, seed=0)),
            num_rounds=10,
            timeout=60,
            train_config=runner.train_config(tiny, {}),
        ).arrays
    finally:
        grid.close()
    late = [r for r in records if r.late]
    assert late, "no party was late: lower deadline_factor"
    # A late reply is folded one round later, into its own architecture's mean: seed 0's
    # round 3 (tier 0, mlp-large) was late and round 4 trained the slow tier's slice, so
    # round 4 folded both architectures at once, and no reply was refused for its shapes.
    tiers = {r.server_round: r.tier for r in records}
    mixed = [r for r in records if r.stale_folded and tiers[r.server_round - 1] != r.tier]
    assert mixed, "no round folded a late reply of another tier"
    assert all(not r.failures for r in records), [r.failures for r in records]
    digits.load_arrays(digits.make_model(LARGE), final)


@pytest.mark.slow
def test_a_nested_run_completes_and_learns(tiny: Scenario) -> None:
    curve = runner.run_one(tiny, "nested", seed=0)
    assert len(curve.accuracy) == tiny.training.rounds + 1
    assert curve.final_accuracy > 0.3  # well above chance (0.1) after 10 rounds
    # The slow tier's rounds train the half-width slice: less virtual compute than the
    # profiling round, which it dominates on mlp-large.
    slow_rounds = [r for r in curve.rounds[1:] if r.tier == 2]
    assert slow_rounds
    assert max(r.round_time_s for r in slow_rounds) < curve.rounds[0].round_time_s / 2


# ---------------------------------------------------------------- refused up front


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"tier_archs": [LARGE, "mlp", "mlp-small"]}, "'mlp' is not a slice of the global"),
        ({"tier_archs": [LARGE, HALF]}, "one architecture per tier: 3 tiers, 2"),
        ({"tier_archs": None}, "tier_archs: nested needs one architecture per tier"),
        ({"tier_archs": [LARGE, LARGE, "cnn"]}, "unknown architecture"),
        ({"arch": LARGE}, "strategies.nested.arch: not a parameter of nested"),
        ({"distill_epochs": 3}, "distill_epochs: not a parameter of nested"),
        ({"server_opt": "fedadam"}, "kind 'nested' has no server optimizer"),
        ({"privacy": {"secagg": True}}, "SecAgg\\+ yields one aggregate per round; nested"),
        (
            {"privacy": {"mode": "central", "noise_multiplier": 1.0, "clipping_norm": 0.5}},
            "mode 'central' clips one model's updates; nested",
        ),
    ],
)
def test_what_cannot_nest_is_refused_before_any_round(
    tiny: Scenario, change: dict[str, object], says: str
) -> None:
    params = {k: v for k, v in {**tiny.strategy("nested"), **change}.items() if v is not None}
    with pytest.raises(StrategyConfigError, match=says):
        build_strategy(
            "nested",
            params,
            per_round=4,
            seed=0,
            clock=ClockMode.VIRTUAL,
        )


def test_global_arrays_of_another_architecture_are_refused(tiny: Scenario) -> None:
    strategy = _nested(tiny)
    grid = InProcessGrid(client_app, 6, run_config=runner.run_config(tiny, 0), workers=2)
    try:
        with pytest.raises(ValueError, match="must be a 'mlp-large' model"):
            strategy.start(
                grid,
                digits.to_arrays(digits.make_model(HALF, seed=0)),
                num_rounds=2,
                timeout=60,
                train_config=runner.train_config(tiny, {}),
            )
    finally:
        grid.close()


def test_the_server_apps_run_config_carries_the_tier_architectures() -> None:
    config: dict[str, bool | int | float | str] = {
        "strategy": "nested", "scenario": "s.toml", "seed": 1, "run-store": "runs.db",
        "tiers": 3, "tier-archs": "mlp-large, mlp-large,mlp-large-half",
        "distill-epochs": 4,
    }  # fmt: skip
    params = ServerSettings.from_run_config(config).strategy_params
    assert params == {"tiers": 3, "tier_archs": [LARGE, LARGE, HALF]}

"""Run a scenario's strategies over seeds and compare them by time to accuracy.

Each run is one Flower strategy driving the scenario's parties (fedge's ClientApp) on a
Grid: the in-process one by default, Flower's simulation runtime with ``backend="flower"``.
The clock is virtual: a round lasts as long as its parties' reported device times say
(see :mod:`fedge.aggregator.strategies.streaming`), so results are deterministic for a seed.
"""

import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from uuid import uuid4

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fedge.aggregator.driver import start_rounds
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.strategies.factory import build_strategy
from fedge.datasets.tables import Partitions
from fedge.models import digits
from fedge.privacy.settings import PrivacyMode
from fedge.sim.data import make_partitions
from fedge.sim.party_inputs import PARTIES_KEY
from fedge.sim.scenario import Scenario

ProgressFn = Callable[[str, int, int], None]  # (run label, round, total rounds)


@dataclass(frozen=True)
class Curve:
    strategy: str
    seed: int
    times_s: tuple[float, ...]  # virtual time at the end of each round (round 0 = 0)
    accuracy: tuple[float, ...]
    target: float
    group_accuracy: tuple[float, ...]  # final model on each speed group's local data
    wall_s: float
    rounds: tuple[RoundRecord, ...] = field(repr=False, default=())
    epsilon: tuple[float, ...] = ()
    """Privacy spent by the end of each round (round 0 = 0): the most any party spent
    (DP-SGD), or the station-level epsilon of the released aggregates (central DP);
    empty without privacy."""

    round_wall_s: tuple[float, ...] = ()
    """Real seconds each round took (training compute and orchestration, not virtual)."""

    @property
    def wall_s_per_round(self) -> float:
        """The median real seconds of a round: the first rounds pay one-off costs (imports,
        warm-up), and the machine is shared, so the median is what a round costs."""
        if self.round_wall_s:
            return statistics.median(self.round_wall_s)
        return self.wall_s / max(1, len(self.rounds))

    @property
    def final_accuracy(self) -> float:
        return self.accuracy[-1]

    @property
    def converged_accuracy(self) -> float:
        """Mean test accuracy over the last tenth of the rounds (at least one round).

        Round-to-round accuracy of a federated model jitters by a point or more (each
        round is a few parties' data); the mean over the run's tail is what it converged to.
        """
        tail = self.accuracy[1:][-max(1, (len(self.accuracy) - 1) // 10) :] or self.accuracy
        return sum(tail) / len(tail)

    @property
    def time_to_target_s(self) -> float | None:
        """First virtual time the test accuracy reached the target; None = censored."""
        for t, acc in zip(self.times_s, self.accuracy, strict=True):
            if acc >= self.target:
                return t
        return None


def run_config(
    scenario: Scenario, seed: int, privacy_dir: str = ""
) -> dict[str, bool | int | float | str]:
    """What every party of a run reads; ``privacy_dir`` holds the parties' DP ledgers."""
    config: dict[str, bool | int | float | str] = {
        "scenario": scenario.source or scenario.name,
        "seed": seed,
        # The fleet's size as run, which may not be the file's (``--parties``).
        PARTIES_KEY: scenario.fleet.parties,
    }
    if privacy_dir:
        config["privacy-dir"] = privacy_dir
    return config


def evaluator(
    scenario: Scenario, data: Partitions, *, arch: str | None = None
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Test accuracy of an ``arch`` model (default: the scenario's ``training.arch``)."""
    model = digits.make_model(arch or scenario.training.arch)
    test_x, test_y = data.test

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        digits.load_arrays(model, arrays)
        return MetricRecord({"accuracy": digits.accuracy(model, test_x, test_y)})

    return evaluate


def group_accuracy(
    scenario: Scenario, data: Partitions, arrays: ArrayRecord, *, arch: str | None = None
) -> tuple[float, ...]:
    """Accuracy of a model on each speed group's parties' data (TiFL's per-tier view).

    Scored a few hundred parties at a time: at fleet scale (10,000 parties) their data
    together would be the run's largest allocation, and is drawn only to be scored.
    """
    model = digits.make_model(arch or scenario.training.arch)
    digits.load_arrays(model, arrays)
    grouped = bool(scenario.fleet.groups)  # a lognormal fleet is one group
    result = []
    for group in range(len(scenario.fleet.groups) or 1):
        members = [
            p for p in range(data.num_parties) if not grouped or scenario.fleet.group_of(p) == group
        ]
        correct, total = 0.0, 0
        for start in range(0, len(members), _SCORED_TOGETHER):
            chunk = [data.parties[p] for p in members[start : start + _SCORED_TOGETHER]]
            chunk = [(x, y) for x, y in chunk if len(y)]
            if not chunk:
                continue
            ys = np.concatenate([y for _, y in chunk])
            xs = np.concatenate([x for x, _ in chunk])
            correct += digits.accuracy(model, xs, ys) * len(ys)
            total += len(ys)
        if total:
            result.append(correct / total)
    return tuple(result)


_SCORED_TOGETHER = 256  # parties whose data group_accuracy scores in one pass


def train_config(scenario: Scenario, extra: Mapping[str, float | str]) -> ConfigRecord:
    training = scenario.training
    config: dict[str, int | float | str] = {
        "lr": training.lr,
        "local-epochs": training.local_epochs,
        "batch-size": training.batch_size,
        "arch": training.arch,
    }
    config.update(extra)
    return ConfigRecord(config)  # type: ignore[arg-type]


def run_one(
    scenario: Scenario,
    strategy_name: str,
    seed: int,
    *,
    backend: str = "inprocess",
    progress: ProgressFn | None = None,
    workers: int = 2,
    ray_address: str | None = None,
) -> Curve:
    if backend == "flower":
        from fedge.sim.flower_backend import run_on_flower

        return run_on_flower(
            scenario, strategy_name, seed, progress=progress, ray_address=ray_address
        )
    if ray_address:
        raise ValueError("a Ray cluster address needs the flower backend (--backend flower)")
    if backend != "inprocess":
        raise ValueError(f"unknown backend {backend!r} (inprocess or flower)")
    from fedge.sim.grid import InProcessGrid
    from fedge.sim.party_app import app as client_app

    data = make_partitions(scenario, seed)
    with tempfile.TemporaryDirectory(prefix="fedge-ledgers-") as ledgers:
        config = run_config(scenario, seed, ledgers)
        grid = InProcessGrid(client_app, scenario.fleet.parties, run_config=config, workers=workers)
        try:
            return drive(scenario, strategy_name, seed, grid, data, progress)
        finally:
            grid.close()


def drive(
    scenario: Scenario,
    strategy_name: str,
    seed: int,
    grid: object,
    data: Partitions,
    progress: ProgressFn | None,
) -> Curve:
    """Run one strategy on a ready grid (shared by both backends)."""
    from flwr.serverapp import Grid

    assert isinstance(grid, Grid)
    from fedge.sim import flower_native

    if flower_native.is_native(scenario.strategy(strategy_name)):  # Flower's own, the peer
        return flower_native.drive_native(scenario, strategy_name, seed, grid, data, progress)
    started = time.perf_counter()
    strategy, extra = build_strategy(
        strategy_name,
        scenario.strategy(strategy_name),
        per_round=scenario.fleet.per_round,
        seed=seed,
        clock=ClockMode.VIRTUAL,
        proxy_X=data.proxy_X,
    )
    # A strategy may train another arch than the scenario's (fedavg's arch, distill's
    # largest tier arch): the initial and evaluated model follow the train config.
    arch = str(extra.get("arch", scenario.training.arch))
    records: list[RoundRecord] = []
    total = scenario.rounds_for(strategy_name)
    label = f"{strategy_name} seed {seed}"

    round_walls: list[float] = []
    last = [time.perf_counter()]

    def observe(record: RoundRecord) -> None:
        now = time.perf_counter()
        round_walls.append(now - last[0])
        last[0] = now
        records.append(record)
        if progress is not None:
            progress(label, record.server_round, total)

    strategy.observers.append(observe)
    # One job per run: parties account their DP-SGD rounds under this id.
    strategy.job_id = f"{strategy_name}/seed-{seed}/{uuid4().hex[:8]}"
    spent = _SpentTracker()
    strategy.reply_observers.append(spent.observe)
    initial = digits.to_arrays(digits.make_model(arch, seed=seed))
    result, central = start_rounds(
        strategy,
        grid,
        initial,
        num_rounds=total,
        timeout=600,
        train_config=train_config(scenario, extra),
        evaluate_fn=evaluator(scenario, data, arch=arch),
        max_weight=float(max(data.party_size(p) for p in range(data.num_parties))),
    )
    evaluated = result.evaluate_metrics_serverapp
    accuracies = [float(evaluated[r.server_round]["accuracy"]) for r in records]  # type: ignore[arg-type]
    accuracies.insert(0, float(evaluated[0]["accuracy"]))  # type: ignore[arg-type]
    if central is not None:
        spent.by_round = central.epsilon_by_round
    return Curve(
        strategy=strategy_name,
        seed=seed,
        times_s=(0.0, *(r.elapsed_s for r in records)),
        accuracy=tuple(accuracies),
        target=scenario.training.target_accuracy,
        group_accuracy=group_accuracy(scenario, data, result.arrays, arch=arch),
        wall_s=time.perf_counter() - started,
        rounds=tuple(records),
        round_wall_s=tuple(round_walls),
        epsilon=spent.curve(records) if strategy.privacy.mode is not PrivacyMode.NONE else (),
    )


class _SpentTracker:
    """Privacy spent by round: the most any party reported having spent in this job."""

    def __init__(self) -> None:
        self.by_round: dict[int, float] = {}
        self._most = 0.0

    def observe(self, record: RoundRecord, replies: dict[int, Message]) -> None:
        for reply in replies.values():
            for metrics in reply.content.metric_records.values():
                value = metrics.get("dp-epsilon-job")
                if isinstance(value, int | float):
                    self._most = max(self._most, float(value))
        self.by_round[record.server_round] = self._most

    def curve(self, records: Sequence[RoundRecord]) -> tuple[float, ...]:
        values, last = [0.0], 0.0
        for record in records:
            last = self.by_round.get(record.server_round, last)
            values.append(last)
        return tuple(values)


@dataclass(frozen=True)
class Comparison:
    scenario: str
    curves: tuple[Curve, ...]
    baseline: str

    def by(self, strategy: str) -> list[Curve]:
        return [c for c in self.curves if c.strategy == strategy]

    def speedups(self, strategy: str) -> dict[int, float | None]:
        """Baseline TTA / strategy TTA per seed (None when either is censored)."""
        result: dict[int, float | None] = {}
        base = {c.seed: c.time_to_target_s for c in self.by(self.baseline)}
        for curve in self.by(strategy):
            ours, theirs = curve.time_to_target_s, base.get(curve.seed)
            result[curve.seed] = (
                None if ours is None or theirs is None or ours == 0 else theirs / ours
            )
        return result

    def summary(self) -> dict[str, object]:
        strategies = sorted({c.strategy for c in self.curves}, key=self._order)
        summary: dict[str, object] = {
            "scenario": self.scenario,
            "baseline": self.baseline,
            "final_accuracy": {
                s: _median([c.final_accuracy for c in self.by(s)]) for s in strategies
            },
            "converged_accuracy": {
                s: _median([c.converged_accuracy for c in self.by(s)]) for s in strategies
            },
            "worst_tier_accuracy": {
                s: _median([min(c.group_accuracy) for c in self.by(s) if c.group_accuracy])
                for s in strategies
            },
            "censored": {
                s: sum(c.time_to_target_s is None for c in self.by(s)) for s in strategies
            },
            "time_to_target_s": {
                s: {str(c.seed): c.time_to_target_s for c in self.by(s)} for s in strategies
            },
            "wall_s": {s: round(sum(c.wall_s for c in self.by(s)), 2) for s in strategies},
            "wall_s_per_round": {
                s: _median([c.wall_s_per_round for c in self.by(s)]) for s in strategies
            },
        }
        private = [s for s in strategies if any(c.epsilon for c in self.by(s))]
        if private:
            summary["epsilon_spent"] = {
                s: _median([c.epsilon[-1] for c in self.by(s) if c.epsilon]) for s in private
            }
            summary["privacy_cost"] = {s: self._privacy_cost(s) for s in private}
        others = [s for s in strategies if s != self.baseline]
        if others:
            speedups = self.speedups(others[0])
            values = [v for v in speedups.values() if v is not None]
            summary["tta_speedup"] = {
                "strategy": others[0],
                "median": _median(values) if values else None,
                "min": min(values) if values else None,
                "per_seed": {str(k): v for k, v in speedups.items()},
            }
        return summary

    def _privacy_cost(self, strategy: str) -> dict[str, float | None]:
        """What privacy cost against the baseline, paired by seed (medians over seeds)."""
        base = {c.seed: c for c in self.by(self.baseline)}
        drops, ratios = [], []
        for curve in self.by(strategy):
            other = base.get(curve.seed)
            if other is None:
                continue
            drops.append((other.converged_accuracy - curve.converged_accuracy) * 100)
            if other.wall_s_per_round > 0:
                ratios.append(curve.wall_s_per_round / other.wall_s_per_round)
        return {
            "converged_accuracy_drop_points": _median(drops) if drops else None,
            "round_time_ratio": _median(ratios) if ratios else None,
        }

    def _order(self, strategy: str) -> tuple[int, str]:
        return (0 if strategy == self.baseline else 1, strategy)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def compare(
    scenario: Scenario,
    strategies: Sequence[str],
    seeds: Sequence[int],
    *,
    backend: str = "inprocess",
    progress: ProgressFn | None = None,
    ray_address: str | None = None,
) -> Comparison:
    curves = [
        run_one(scenario, name, seed, backend=backend, progress=progress, ray_address=ray_address)
        for seed in seeds
        for name in strategies
    ]
    return Comparison(scenario.name, tuple(curves), baseline=strategies[0])

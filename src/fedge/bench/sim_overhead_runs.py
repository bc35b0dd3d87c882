"""The sim-overhead benchmark's runs: one timed run of one side, and the Flower phase.

:class:`Workload` (parties, parties per round, rounds, model size, seed) and
:class:`RunTiming` (every round's wall time in one run, and the figure it gives: seconds
per party-round over the rounds after the warm-up) are the values passed around. A run's
rounds are timed by an ``evaluate_fn`` that only notes when it is called
(:class:`_Stamps`). :func:`run_ours` drives our tiered strategy on a grid,
:func:`run_flower_fedavg` Flower's ``FedAvg.start``; :func:`inprocess_pair` runs the
in-process side and its 1 ms-polling diagnostic on a fresh ``InProcessGrid``, and
:func:`flower_phase` both Flower sides, alternating, in one Ray simulation. The benchmark
that puts them together is :mod:`fedge.bench.sim_overhead`.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedge.aggregator.fleet.grids import wait_for_nodes
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.strategies.factory import build_strategy
from fedge.bench import Progress
from fedge.bench.sim_overhead_apps import echo_app, initial_arrays
from fedge.bench.testbed import BenchError

# Diagnostic, not a target: the in-process side with the strategy polling the grid every
# 1 ms instead of StreamingFedAvg's default 10 ms (the in-process rounds wait mostly there).
DIAGNOSTIC_SIDE = "inprocess_pull_1ms"
DIAGNOSTIC_PULL_INTERVAL_S = 0.001
STRATEGY = "tiered"
# Two tiers of parties/2: a tier holds per_round parties at the defaults (20, 10).
TIERED_PARAMS: dict[str, object] = {
    "kind": "tiered",
    "tiers": 2,
    "profiling_rounds": 1,
    "adaptive": False,
    "static_probabilities": [0.5, 0.5],
}
WARMUP_ROUNDS = 1  # = the tiered strategy's profiling rounds
ROUND_TIMEOUT_S = 120.0


# ---------------------------------------------------------------- one run of one side


@dataclass(frozen=True)
class RunTiming:
    side: str
    repetition: int
    round_s: tuple[float, ...]  # every round's wall time, warm-up included
    parties_per_round: tuple[int, ...]  # parties asked in each round

    @property
    def timed_round_s(self) -> tuple[float, ...]:
        return self.round_s[WARMUP_ROUNDS:]

    @property
    def party_rounds(self) -> int:
        return sum(self.parties_per_round[WARMUP_ROUNDS:])

    @property
    def s_per_party_round(self) -> float:
        return sum(self.timed_round_s) / self.party_rounds

    def summary(self) -> dict[str, Any]:
        timed = self.timed_round_s
        return {
            "repetition": self.repetition,
            "s_per_party_round": round(self.s_per_party_round, 7),
            "timed_rounds": len(timed),
            "party_rounds": self.party_rounds,
            "timed_s": round(sum(timed), 5),
            "round_s_median": round(statistics.median(timed), 6),
            "round_s_max": round(max(timed), 6),
            "warmup_round_s": [round(t, 5) for t in self.round_s[:WARMUP_ROUNDS]],
        }


@dataclass(frozen=True)
class Workload:
    parties: int
    per_round: int
    rounds: int  # timed rounds; every run is WARMUP_ROUNDS longer
    params: int
    seed: int

    @property
    def total_rounds(self) -> int:
        return WARMUP_ROUNDS + self.rounds


class _Stamps:
    """An ``evaluate_fn`` that only notes when it was called (before round 1, after each)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        self.times.append(time.perf_counter())
        return None

    def round_s(self, rounds: int) -> tuple[float, ...]:
        if len(self.times) != rounds + 1:
            raise BenchError(f"expected {rounds + 1} round boundaries, got {len(self.times)}")
        return tuple(b - a for a, b in zip(self.times, self.times[1:], strict=False))


def run_ours(
    side: str,
    repetition: int,
    grid: Grid,
    work: Workload,
    *,
    pull_interval_s: float | None = None,
) -> RunTiming:
    """Our tiered strategy for ``work.total_rounds`` rounds on ``grid`` (as runner.drive).

    ``pull_interval_s`` overrides the strategy's polling interval (diagnostic only).
    """
    strategy, extra = build_strategy(
        STRATEGY, TIERED_PARAMS, per_round=work.per_round, seed=work.seed, clock=ClockMode.VIRTUAL
    )
    if pull_interval_s is not None:
        strategy.pull_interval_s = pull_interval_s
    records: list[RoundRecord] = []
    strategy.observers.append(records.append)
    stamps = _Stamps()
    strategy.start(
        grid,
        initial_arrays(work.params, work.seed),
        num_rounds=work.total_rounds,
        timeout=ROUND_TIMEOUT_S,
        train_config=ConfigRecord(dict(extra)),
        evaluate_fn=stamps,
    )
    for record in records:
        if record.failed or len(record.on_time) != len(record.selected):
            raise BenchError(
                f"{side}: round {record.server_round} had {len(record.failed)} failed and "
                f"{len(record.late)} late parties: {dict(record.failures)}"
            )
    asked = tuple(len(r.selected) for r in records)
    if any(n != work.per_round for n in asked[WARMUP_ROUNDS:]):
        raise BenchError(f"{side}: parties asked per round {asked}, expected {work.per_round}")
    return RunTiming(side, repetition, stamps.round_s(work.total_rounds), asked)


def run_flower_fedavg(repetition: int, grid: Grid, work: Workload) -> RunTiming:
    """Flower's ``FedAvg.start`` for ``work.total_rounds`` rounds, no federated evaluation."""
    strategy = FedAvg(
        fraction_train=work.per_round / work.parties,
        fraction_evaluate=0.0,
        min_train_nodes=work.per_round,
        min_evaluate_nodes=0,
        min_available_nodes=work.parties,
    )
    stamps = _Stamps()
    result = strategy.start(
        grid,
        initial_arrays(work.params, work.seed),
        num_rounds=work.total_rounds,
        timeout=ROUND_TIMEOUT_S,
        train_config=ConfigRecord(),
        evaluate_fn=stamps,
    )
    # FedAvg records a round's train metrics only when it aggregated valid replies.
    if sorted(result.train_metrics_clientapp) != list(range(1, work.total_rounds + 1)):
        raise BenchError(
            f"flower_fedavg: aggregated rounds {sorted(result.train_metrics_clientapp)}, "
            f"expected 1..{work.total_rounds}"
        )
    # int(parties * fraction) (>= min_train_nodes) parties are sampled every round.
    asked = max(int(work.parties * strategy.fraction_train), work.per_round)
    return RunTiming(
        "flower_fedavg",
        repetition,
        stamps.round_s(work.total_rounds),
        (asked,) * work.total_rounds,
    )


def run_inprocess(
    repetition: int,
    work: Workload,
    *,
    side: str = "inprocess",
    pull_interval_s: float | None = None,
) -> RunTiming:
    """Our default backend: a fresh InProcessGrid (2 workers, as run_one) and our strategy."""
    from fedge.sim.grid import InProcessGrid

    grid = InProcessGrid(echo_app, work.parties, run_config=_run_config(work))
    try:
        return run_ours(side, repetition, grid, work, pull_interval_s=pull_interval_s)
    finally:
        grid.close()


def inprocess_pair(
    repetition: int, repeats: int, work: Workload, progress: Progress
) -> list[RunTiming]:
    """One run of the in-process side and one of its diagnostic, alternating which is first."""
    progress(f"inprocess: run {repetition + 1}/{repeats}")
    sides: list[tuple[str, float | None]] = [
        ("inprocess", None),
        (DIAGNOSTIC_SIDE, DIAGNOSTIC_PULL_INTERVAL_S),
    ]
    if repetition % 2:
        sides.reverse()
    return [
        run_inprocess(repetition, work, side=side, pull_interval_s=interval)
        for side, interval in sides
    ]


def _run_config(work: Workload) -> dict[str, bool | int | float | str]:
    return {"benchmark": "sim-overhead", "seed": work.seed}


# ---------------------------------------------------------------- the Flower phase


def flower_phase(
    work: Workload, repeats: int, num_cpus: int, progress: Progress
) -> tuple[list[RunTiming], float]:
    """Both Flower sides, ``repeats`` times each, alternating, in one Ray simulation."""

    from fedge.aggregator.fleet.identity import PartitionOrderedGrid
    from fedge.sim.flower_backend import launch_simulation

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    config = _run_config(work)
    timings: list[RunTiming] = []
    ready: list[float] = []

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        # The runtime registers its nodes after it started this thread: wait for them.
        if wait_for_nodes(grid, work.parties, ROUND_TIMEOUT_S, poll_s=0.05) < work.parties:
            raise BenchError(f"Flower's runtime did not register {work.parties} nodes")
        ordered = PartitionOrderedGrid(grid)
        # Place every node now (one query each; this also loads the ClientApp in every
        # actor), so no run's rounds carry the discovery.
        placed = len(list(ordered.get_node_ids()))
        if placed != work.parties:
            raise BenchError(f"{placed} of {work.parties} nodes said their partition id")
        ready.append(time.perf_counter())
        for repetition in range(repeats):
            order = ("ours_on_flower", "flower_fedavg")
            for side in order if repetition % 2 == 0 else order[::-1]:
                progress(f"{side}: run {repetition + 1}/{repeats} on Flower's runtime")
                if side == "ours_on_flower":
                    timings.append(run_ours(side, repetition, ordered, work))
                else:
                    timings.append(run_flower_fedavg(repetition, grid, work))

    progress(f"starting Flower's simulation runtime (Ray, {num_cpus} actors)")
    started = time.perf_counter()
    launch_simulation(server_app, echo_app, work.parties, config, num_cpus=num_cpus)
    if len(timings) != 2 * repeats or not ready:
        raise BenchError(
            f"the Flower simulation returned {len(timings)} of {2 * repeats} runs "
            "(see the log above)"
        )
    return timings, ready[0] - started

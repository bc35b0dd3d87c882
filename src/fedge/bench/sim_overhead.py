"""Simulation orchestration overhead: our in-process grid against Flower's runtime.

One workload where orchestration is everything: ``parties`` nodes that run
:data:`echo_app`, a Flower ``ClientApp`` that answers a train message with the arrays it
received and a ``num-examples`` (training costs nothing), ``per_round`` of them asked per
round, a small float32 model (``params`` parameters in two arrays). The same ClientApp
object is run by three sides:

- ``inprocess``: fedge's default simulation backend -- a fresh
  :class:`~fedge.sim.grid.InProcessGrid` (2 workers) per run, driven by our ``tiered``
  strategy (:class:`~fedge.aggregator.tiered.TieredFedAvg` from
  :func:`~fedge.aggregator.factory.build_strategy`, virtual clock, as
  :func:`fedge.sim.runner.drive` builds it; 2 tiers, so a tier holds ``parties / 2``);
- ``ours_on_flower``: the same strategy on Flower's simulation runtime (Ray backend),
  through :class:`~fedge.sim.flower_backend.PartitionOrderedGrid`, as
  :func:`~fedge.sim.flower_backend.run_strategies_on_flower` runs it;
- ``flower_fedavg``: Flower's own ``flwr.serverapp.strategy.FedAvg`` and its ``start()``
  on Flower's grid in the same simulation, ``fraction_train = per_round / parties`` (so the
  same number of parties per round), no federated evaluation.

Both Flower sides run inside ONE ``_run_simulation`` (the mechanism of
:mod:`fedge.sim.flower_backend`: app directory, ``Run``, Ray with ``num_cpus`` one-CPU
actors), alternating which goes first in each repetition; every node is placed by
``PartitionOrderedGrid`` before the first run. The in-process side runs half of its
repetitions before Ray starts and the rest after Ray stopped (bracketing the Flower phase in
time, never sharing the machine with an idle Ray), each paired with a diagnostic run
(``inprocess_pull_1ms``: the strategy polling every 1 ms instead of its default 10 ms).

Timed: the rounds only. Each side gets an ``evaluate_fn`` that only notes the time; both
strategies' ``start()`` call it before round 1 and after every round, so round r lasts from
call r-1 to call r (everything the strategy does in a round: sampling, pushing, waiting,
aggregating). The first ``WARMUP_ROUNDS`` round(s) of every run are not timed: for the
tiered strategy that is its profiling round (every party asked), on Flower's runtime the
first messages of a run. A run's figure is the timed rounds' wall time / (timed rounds x
parties asked per round); the headline per side is the median over runs. Ray's start-up,
node registration and placement (``runtime_ready_s``) and its shut-down are outside every
timed window. Flower's logging below ERROR is off while the benchmark runs (every side).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedge.aggregator.clock import ClockMode
from fedge.aggregator.factory import build_strategy
from fedge.aggregator.rounds import RoundRecord
from fedge.aggregator.streaming import StreamingFedAvg
from fedge.bench import Progress, no_progress
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError

SIDES = ("inprocess", "ours_on_flower", "flower_fedavg")
# Diagnostic, not a target: the in-process side with the strategy polling the grid every
# 1 ms instead of StreamingFedAvg's default 10 ms (the in-process rounds wait mostly there).
DIAGNOSTIC_SIDE = "inprocess_pull_1ms"
DIAGNOSTIC_PULL_INTERVAL_S = 0.001
# What paces a round on Flower's simulation runtime (flwr 1.41): InMemoryGrid's default
# pull_interval, and the runtime's loop that moves pushed messages to the workers
# (vce_api.add_messages_to_queue waits 0.1 s between passes). Reported, not used.
FLOWER_GRID_PULL_INTERVAL_S = 0.1
FLOWER_RUNTIME_POLL_INTERVAL_S = 0.1
TARGET_INPROCESS_SPEEDUP = 10.0
TARGET_STRATEGY_OVERHEAD_RATIO = 1.2
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
ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
NUM_EXAMPLES = "num-examples"
PARTITION_ID = "partition-id"
BASE_EXAMPLES = 8  # "a handful of samples": party p reports 8 + p % 5 examples


# ---------------------------------------------------------------- the party side

echo_app = ClientApp()


def _partition_id(context: Context) -> int:
    value = context.node_config.get(PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"node_config['{PARTITION_ID}'] must be an int, got {value!r}")
    return value


@echo_app.train()
def echo_train(msg: Message, context: Context) -> Message:
    """Reply with the received arrays and a ``num-examples``: no training at all."""
    arrays = msg.content[ARRAYS_KEY]
    partition = _partition_id(context)
    metrics = MetricRecord({NUM_EXAMPLES: BASE_EXAMPLES + partition % 5, PARTITION_ID: partition})
    return Message(RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: metrics}), reply_to=msg)


@echo_app.evaluate()
def echo_evaluate(msg: Message, context: Context) -> Message:
    partition = _partition_id(context)
    metrics = MetricRecord({NUM_EXAMPLES: BASE_EXAMPLES + partition % 5, "eval-acc": 0.0})
    return Message(RecordDict({METRICS_KEY: metrics}), reply_to=msg)


@echo_app.query()
def echo_query(msg: Message, context: Context) -> Message:
    """Which partition this node is (what ``PartitionOrderedGrid`` asks every node once)."""
    metrics = MetricRecord({PARTITION_ID: _partition_id(context)})
    return Message(RecordDict({METRICS_KEY: metrics}), reply_to=msg)


def initial_arrays(params: int, seed: int) -> ArrayRecord:
    """A ``params``-parameter float32 model in two arrays (a weight matrix and a bias)."""
    bias = max(1, params // 100)
    rng = np.random.default_rng(seed)
    return ArrayRecord(
        array_dict={
            "weight": Array(rng.standard_normal(params - bias).astype(np.float32)),
            "bias": Array(np.zeros(bias, np.float32)),
        }
    )


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


def _inprocess_pair(
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


def _flower_phase(
    work: Workload, repeats: int, num_cpus: int, progress: Progress
) -> tuple[list[RunTiming], float]:
    """Both Flower sides, ``repeats`` times each, alternating, in one Ray simulation."""

    from fedge.aggregator.identity import PartitionOrderedGrid
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
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while len(list(grid.get_node_ids())) < work.parties:
            if time.monotonic() > deadline:
                raise BenchError(f"Flower's runtime did not register {work.parties} nodes")
            time.sleep(0.05)
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


# ---------------------------------------------------------------- the benchmark


def _median(timings: Sequence[RunTiming], side: str) -> float:
    return statistics.median(t.s_per_party_round for t in timings if t.side == side)


class _QuietFlower:
    """Flower's logger at ERROR for the duration: its per-round INFO lines (every side) and
    FedAvg's warning that ``fraction_evaluate=0`` skips federated evaluation (every run)."""

    def __enter__(self) -> None:
        self._logger = logging.getLogger("flwr")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)


def run_sim_overhead(
    parties: int = 20,
    per_round: int = 10,
    rounds: int = 20,
    repeats: int = 5,
    *,
    params: int = 10_000,
    seed: int = 0,
    num_cpus: int = 2,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Seconds per party-round of each side on the echo workload, medians over runs."""
    if parties < 2 or not 1 <= per_round <= parties // 2:
        raise BenchError(
            f"need parties >= 2 and 1 <= per_round <= parties / 2 (two tiers of parties / 2), "
            f"got parties={parties}, per_round={per_round}"
        )
    if rounds < 1 or repeats < 1 or params < 2 or num_cpus < 1:
        raise BenchError("rounds, repeats and num_cpus must be >= 1, params >= 2")
    work = Workload(parties, per_round, rounds, params, seed)
    machine = machine_info()
    for package in ("flwr", "ray"):
        machine["versions"][package] = _version(package)
    timings: list[RunTiming] = []
    with _QuietFlower():
        before = (repeats + 1) // 2
        for repetition in range(before):
            timings += _inprocess_pair(repetition, repeats, work, progress)
        flower, runtime_ready_s = _flower_phase(work, repeats, num_cpus, progress)
        timings += flower
        for repetition in range(before, repeats):
            timings += _inprocess_pair(repetition, repeats, work, progress)
    inprocess = _median(timings, "inprocess")
    ours = _median(timings, "ours_on_flower")
    flower_fedavg = _median(timings, "flower_fedavg")
    diagnostic = _median(timings, DIAGNOSTIC_SIDE)
    speedup = flower_fedavg / inprocess
    overhead = ours / flower_fedavg
    return {
        "benchmark": "sim-overhead",
        "inprocess_s_per_party_round": round(inprocess, 7),
        "ours_on_flower_s_per_party_round": round(ours, 7),
        "flower_fedavg_s_per_party_round": round(flower_fedavg, 7),
        "inprocess_speedup": round(speedup, 2),
        "strategy_overhead_ratio": round(overhead, 3),
        "target_inprocess_speedup": TARGET_INPROCESS_SPEEDUP,
        "target_strategy_overhead_ratio": TARGET_STRATEGY_OVERHEAD_RATIO,
        "met_target": bool(
            speedup >= TARGET_INPROCESS_SPEEDUP and overhead <= TARGET_STRATEGY_OVERHEAD_RATIO
        ),
        "parties": parties,
        "per_round": per_round,
        "rounds": rounds,
        "warmup_rounds": WARMUP_ROUNDS,
        "repeats": repeats,
        "params": params,
        "model_bytes": params * 4,
        "strategy": {"name": STRATEGY, **TIERED_PARAMS},
        "ray_cpus": num_cpus,
        "runtime_ready_s": round(runtime_ready_s, 2),
        "diagnostics": {
            f"{DIAGNOSTIC_SIDE}_s_per_party_round": round(diagnostic, 7),
            f"{DIAGNOSTIC_SIDE}_speedup": round(flower_fedavg / diagnostic, 2),
            "strategy_pull_interval_s": StreamingFedAvg(per_round=1).pull_interval_s,
            "flower_grid_pull_interval_s": FLOWER_GRID_PULL_INTERVAL_S,
            "flower_runtime_poll_interval_s": FLOWER_RUNTIME_POLL_INTERVAL_S,
        },
        "runs": {
            side: [t.summary() for t in timings if t.side == side]
            for side in (*SIDES, DIAGNOSTIC_SIDE)
        },
        "measured": (
            "wall time of the rounds inside each strategy's start() (evaluate_fn stamps "
            f"before round 1 and after every round), the first {WARMUP_ROUNDS} round(s) of "
            "every run excluded, / (timed rounds x parties asked per round); medians over "
            "runs. One echo ClientApp for all sides. inprocess: InProcessGrid + tiered "
            "(virtual clock), runs before and after the Ray phase; ours_on_flower: the same "
            "strategy via PartitionOrderedGrid, flower_fedavg: flwr FedAvg.start on "
            "Flower's grid, alternating in one _run_simulation (Ray backend); Ray start-up "
            "not timed; Flower logging below ERROR off"
        ),
        "machine": machine,
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None

"""Simulation orchestration overhead: our in-process grid against Flower's runtime.

One workload where orchestration is everything: ``parties`` nodes that run
:data:`~fedge.bench.sim_overhead_apps.echo_app`, a Flower ``ClientApp`` that answers a
train message with the arrays it received and a ``num-examples`` (training costs
nothing), ``per_round`` of them asked per round, a small float32 model (``params``
parameters in two arrays). The same ClientApp object is run by three sides:

- ``inprocess``: fedge's default simulation backend -- a fresh
  :class:`~fedge.sim.grid.InProcessGrid` (2 workers) per run, driven by our ``tiered``
  strategy (:class:`~fedge.aggregator.strategies.tiered.TieredFedAvg` from
  :func:`~fedge.aggregator.strategies.factory.build_strategy`, virtual clock, as
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

The echo ClientApp and the initial model are in :mod:`fedge.bench.sim_overhead_apps`;
the workload, one run of each side and the Flower phase in
:mod:`fedge.bench.sim_overhead_runs`. This module runs the phases in order and reports.
"""

from __future__ import annotations

import importlib.metadata
import logging
import statistics
from collections.abc import Sequence
from typing import Any

from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.bench import Progress, no_progress
from fedge.bench.machine import machine_info
from fedge.bench.sim_overhead_runs import (
    DIAGNOSTIC_SIDE,
    STRATEGY,
    TIERED_PARAMS,
    WARMUP_ROUNDS,
    RunTiming,
    Workload,
    flower_phase,
    inprocess_pair,
)
from fedge.bench.testbed import BenchError

SIDES = ("inprocess", "ours_on_flower", "flower_fedavg")

# What paces a round on Flower's simulation runtime (flwr 1.41): InMemoryGrid's default
# pull_interval, and the runtime's loop that moves pushed messages to the workers
# (vce_api.add_messages_to_queue waits 0.1 s between passes). Reported, not used.
FLOWER_GRID_PULL_INTERVAL_S = 0.1
FLOWER_RUNTIME_POLL_INTERVAL_S = 0.1
TARGET_INPROCESS_SPEEDUP = 10.0
TARGET_STRATEGY_OVERHEAD_RATIO = 1.2


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
            timings += inprocess_pair(repetition, repeats, work, progress)
        flower, runtime_ready_s = flower_phase(work, repeats, num_cpus, progress)
        timings += flower
        for repetition in range(before, repeats):
            timings += inprocess_pair(repetition, repeats, work, progress)
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

"""``fedge bench sim-scale``: the simulator at fleet size -- time per round and memory.

A plant operator asks "what happens with 10,000 stations?" before buying hardware (issue
29). For each size, one fresh process (``python -m fedge.bench.sim_scale child``) runs
``scenario`` (``fleet-scale`` by default: ~40 inspection images a station, drawn when a
station is first asked) resized to that many parties, through :func:`fedge.sim.runner.
run_one` -- the path ``fedge sim --parties N`` runs -- and reports:

- ``seconds_per_round``: the median wall time of its rounds (the parties asked per round
  stay the scenario's, so a round's own work does not grow with the fleet: what grows is
  what the simulator keeps per party and any pass over all of them);
- ``peak_rss_mb``: the process's own peak resident memory (``VmHWM``, not ``ru_maxrss``,
  which on exec inherits the parent's peak: bench/aggregate_memory.py);
- ``rss_per_party_kb``: (peak - the resident memory before the run, after imports and the
  data set) / parties; the top-level ``marginal_rss_per_party_kb`` is the growth from the
  smallest size to the largest per added party, fixed costs cancelled.

The peer, side by side at the same sizes up to ``peer_max`` (``--peer-max``, 1,000 by
default; 0 skips it): the same scenario on Flower's own simulation runtime (Ray,
``--backend flower``), whose per-round time and memory are reported beside ours with
their ratio. Above that the peer is not run (and the JSON says so): Flower registers every
node and the grid asks each its partition once through the Ray actors, which at 10,000
nodes on 2 cores takes longer than the whole in-process run.

Targets: time per round and memory grow at most linearly -- the largest size within
(largest / smallest) x 1.2 of the smallest (10,000 within 12x of 1,000) -- and peak RSS at
the largest size <= 8 GiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from fedge.bench import Progress, no_progress
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError

SCENARIO = "fleet-scale"
STRATEGY = "fedavg"
PEAK_TARGET_MB = 8 * 1024
GROWTH_SLACK = 1.2  # "10,000 within 12x of 1,000": linear growth with 20 % to spare
CHILD_TIMEOUT_S = 3600


def run_sim_scale(
    sizes: Sequence[int] = (1_000, 10_000),
    *,
    rounds: int = 5,
    scenario: str = SCENARIO,
    strategy: str = STRATEGY,
    seed: int = 0,
    peer_max: int = 1_000,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    ordered = sorted(set(sizes))
    if not ordered or ordered[0] < 1:
        raise BenchError(f"--parties needs sizes >= 1, got {list(sizes)}")
    if rounds < 2:
        raise BenchError(
            f"--rounds must be >= 2 (the first round pays one-off costs), got {rounds}"
        )
    measured = []
    for parties in ordered:
        progress(f"{parties} parties, in process")
        ours = _run_child(scenario, strategy, parties, rounds, seed, "inprocess")
        entry: dict[str, Any] = dict(ours)
        if parties > peer_max:
            # Flower's runtime registers every node and fedge's grid asks each once which
            # partition it is, through the Ray actors: at 10,000 nodes on 2 cores that
            # alone takes longer than the whole in-process run.
            entry["peer_flower"] = None
            entry["peer_skipped"] = f"more than --peer-max {peer_max} parties"
        else:
            progress(f"{parties} parties, Flower's simulation runtime")
            flower = _run_child(scenario, strategy, parties, rounds, seed, "flower")
            entry["peer_flower"] = flower
            entry["ratio_seconds_per_round"] = _ratio(
                ours["seconds_per_round"], flower["seconds_per_round"]
            )
            entry["ratio_peak_rss"] = _ratio(ours["peak_rss_mb"], flower["peak_rss_mb"])
        measured.append(entry)
    small, large = measured[0], measured[-1]
    scale = large["parties"] / small["parties"]
    allowed = max(1.0, scale * GROWTH_SLACK)
    time_growth = _ratio(large["seconds_per_round"], small["seconds_per_round"])
    rss_growth = _ratio(large["peak_rss_mb"], small["peak_rss_mb"])
    added = large["parties"] - small["parties"]
    marginal = (
        round((large["peak_rss_mb"] - small["peak_rss_mb"]) * 1024 / added, 3) if added else None
    )
    return {
        "benchmark": "sim-scale",
        "machine": machine_info(),
        "scenario": scenario,
        "strategy": strategy,
        "rounds": rounds,
        "seed": seed,
        "sizes": measured,
        "time_growth": time_growth,
        "rss_growth": rss_growth,
        "allowed_growth": round(allowed, 2),
        "marginal_rss_per_party_kb": marginal,
        "targets": {"peak_rss_mb": PEAK_TARGET_MB, "growth_within": round(allowed, 2)},
        "met_target": (
            time_growth is not None
            and rss_growth is not None
            and time_growth <= allowed
            and rss_growth <= allowed
            and large["peak_rss_mb"] <= PEAK_TARGET_MB
        ),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def _run_child(
    scenario: str, strategy: str, parties: int, rounds: int, seed: int, backend: str
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "fedge.bench.sim_scale", "child", scenario, strategy,
        "--parties", str(parties), "--rounds", str(rounds), "--seed", str(seed),
        "--backend", backend,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=CHILD_TIMEOUT_S
    )
    if result.returncode != 0:
        raise BenchError(
            f"{parties} parties on the {backend} backend failed (exit {result.returncode}): "
            f"{result.stderr.strip()[-800:]}"
        )
    info: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return info


# ---------------------------------------------------------------- the child


def _child(
    scenario_name: str, strategy: str, parties: int, rounds: int, seed: int, backend: str
) -> dict[str, Any]:
    import logging

    from fedge.bench.aggregate_memory import malloc_trim, reset_peak_rss, status_kib
    from fedge.sim.data import make_partitions
    from fedge.sim.runner import run_one
    from fedge.sim.scenario import load_scenario

    logging.getLogger("flwr").setLevel(logging.WARNING)
    scenario = load_scenario(scenario_name).with_rounds(rounds).with_parties(parties)
    make_partitions(scenario, seed)  # the data set and its test split: not per party
    malloc_trim()
    reset_peak_rss()
    baseline_kib = status_kib("VmRSS")
    started = time.perf_counter()
    curve = run_one(scenario, strategy, seed, backend=backend)
    wall_s = time.perf_counter() - started
    peak_kib = status_kib("VmHWM")
    # The first round pays one-off costs (imports on first use, Ray's actors): the median
    # of the others is what a round costs at this size.
    if len(curve.rounds) < rounds:
        raise BenchError(
            f"{parties} parties on the {backend} backend completed {len(curve.rounds)} of "
            f"{rounds} rounds"
        )
    steady = curve.round_wall_s[1:] or curve.round_wall_s
    return {
        "parties": parties,
        "backend": backend,
        "per_round": scenario.fleet.per_round,
        "seconds_per_round": round(statistics.median(steady), 4),
        "first_round_s": round(curve.round_wall_s[0], 3) if curve.round_wall_s else None,
        "wall_s": round(wall_s, 2),
        "peak_rss_mb": round(peak_kib / 1024, 1),
        "baseline_rss_mb": round(baseline_kib / 1024, 1),
        "rss_per_party_kb": round((peak_kib - baseline_kib) / parties, 3),
        "final_accuracy": round(curve.final_accuracy, 4),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedge.bench.sim_scale")
    sub = parser.add_subparsers(dest="command", required=True)
    child = sub.add_parser("child", help="one size, one backend; prints one JSON line")
    child.add_argument("scenario")
    child.add_argument("strategy")
    child.add_argument("--parties", type=int, required=True)
    child.add_argument("--rounds", type=int, required=True)
    child.add_argument("--seed", type=int, default=0)
    child.add_argument("--backend", choices=("inprocess", "flower"), default="inprocess")
    args = parser.parse_args(argv)
    result = _child(
        args.scenario, args.strategy, args.parties, args.rounds, args.seed, args.backend
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

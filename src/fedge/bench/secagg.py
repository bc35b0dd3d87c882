"""``fedge bench secagg``: SecAgg+ rounds against plain FedAvg rounds, in one simulation.

One Flower simulation (Ray) of ``parties`` echo parties (:mod:`fedge.bench.secagg_apps`:
each sends the model plus a small offset of its own) over a ``params``-parameter float32
model. Each timed round runs twice on the same grid from the same model: once through
SecAgg+ (:func:`fedge.aggregator.privacy.secagg.run_secagg`) and once as plain FedAvg
(``StreamingFedAvg``), every party asked both times. One untimed warm-up round of each
comes first (Ray starts its actors). Reported:

- ``seconds_per_round`` / ``plain_seconds_per_round``: medians over the timed rounds;
  ``ratio`` is their quotient;
- ``max_abs_error``: the largest |SecAgg+ model - plain model| over every round (the
  same updates, so only SecAgg+'s quantisation differs), with ``error_bound`` from
  :func:`~fedge.aggregator.privacy.secagg.quantization_error_bound`;
- ``dropouts_survived``: one more SecAgg+ round in which party 1 dies before sending its
  masked vector; 1 when that round still ends with the weighted mean of the others
  (within the bound), else 0.
- ``silent_dropouts_survived``: the same on real processes, where the party dies
  silently: a SuperLink and ``silent.parties`` SuperNodes, one SIGKILLed after SecAgg+'s
  key stages and before its masked vector (:mod:`fedge.bench.secagg_silent`), beside
  ``silent_round_s`` against its bound ``silent_round_bound_s`` and the clean round on the
  same processes (``silent_clean_round_s``, ``silent_ratio``). ``silent=None`` skips it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedge.aggregator.fleet.grids import wait_for_nodes
from fedge.aggregator.fleet.identity import PartitionOrderedGrid
from fedge.aggregator.privacy.secagg import SecAggSettings, run_secagg
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.bench.machine import machine_info
from fedge.bench.secagg_apps import (
    BASE_EXAMPLES,
    DROP_PARTITION,
    DROP_STAGE,
    secagg_app,
)
from fedge.bench.secagg_silent import SilentSettings, run_silent_dropout, silent_verdict
from fedge.bench.secagg_silent_server import survivors_bound, weighted_mean
from fedge.bench.sim_overhead_apps import initial_arrays
from fedge.sim.flower_backend import RAY_CPUS, launch_simulation

NODE_WAIT_S = 120.0
ROUND_TIMEOUT_S = 600.0
DROPPED_PARTITION = 1
# Every party's weight n / max_weight stays <= 1, so no update is clipped (|values| < 8).
MAX_WEIGHT = float(BASE_EXAMPLES + 4 + 4)


def run_secagg_bench(
    parties: int = 10,
    params: int = 1_000_000,
    rounds: int = 3,
    *,
    seed: int = 0,
    num_cpus: int = RAY_CPUS,
    progress: Callable[[str], None] | None = None,
    silent: SilentSettings | None = None,
) -> dict[str, Any]:
    if parties < 4:
        raise ValueError(
            f"--parties must be >= 4 (one is killed in the dropout round, and SecAgg+ "
            f"never unmasks fewer than 3), got {parties}"
        )
    if params < 2:
        raise ValueError(f"--params must be >= 2, got {params}")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    say = progress or (lambda _line: None)
    settings = SecAggSettings(reconstruction_threshold=0.5, max_weight=MAX_WEIGHT)
    arrays = initial_arrays(params, seed)
    sent = {k: a.numpy() for k, a in arrays.items()}
    secure_s: list[float] = []
    plain_s: list[float] = []
    errors: list[float] = []
    dropout: dict[str, Any] = {}

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        ordered = PartitionOrderedGrid(grid)
        _wait_for_nodes(ordered, parties)
        secure = StreamingFedAvg(per_round=parties, seed=seed)
        plain = StreamingFedAvg(per_round=parties, seed=seed)
        for server_round in range(1, rounds + 2):  # round 1 warms Ray up
            say(f"round {server_round}/{rounds + 1}: SecAgg+")
            started = time.perf_counter()
            secured = run_secagg(
                ordered,
                secure,
                arrays,
                settings,
                num_rounds=server_round,
                first_round=server_round,
                timeout=ROUND_TIMEOUT_S,
            ).arrays
            secure_time = time.perf_counter() - started
            say(f"round {server_round}/{rounds + 1}: plain FedAvg")
            started = time.perf_counter()
            plained = plain.start(
                ordered,
                arrays,
                num_rounds=server_round,
                first_round=server_round,
                timeout=ROUND_TIMEOUT_S,
            ).arrays
            plain_time = time.perf_counter() - started
            assert secured is not None and plained is not None
            errors.append(_max_abs_difference(secured, plained))
            if server_round > 1:
                secure_s.append(secure_time)
                plain_s.append(plain_time)
        say("dropout round: one party killed before its masked vector")
        records: list[RoundRecord] = []
        dropper = StreamingFedAvg(per_round=parties, seed=seed)
        dropper.observers.append(records.append)
        killed = ConfigRecord({DROP_PARTITION: DROPPED_PARTITION, DROP_STAGE: "collect"})
        survived = run_secagg(
            ordered, dropper, arrays, settings, num_rounds=1, train_config=killed
        ).arrays
        assert survived is not None
        rest = [p for p in range(parties) if p != DROPPED_PARTITION]
        expected = weighted_mean(sent, rest)
        dropout["error"] = max(
            float(np.abs(survived[k].numpy().astype(np.float64) - expected[k]).max())
            for k in expected
        )
        dropout["bound"] = survivors_bound(sent, rest, settings)
        dropout["completed"] = bool(records) and len(records[-1].on_time) == len(rest)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    launch_simulation(server_app, secagg_app, parties, {"seed": seed}, num_cpus=num_cpus)
    if len(secure_s) != rounds or not dropout:
        raise RuntimeError(f"the simulation ended after {len(secure_s)} of {rounds} timed rounds")
    silent_figures: dict[str, Any] = {"silent_dropouts_survived": None, "silent": "skipped"}
    if silent is not None:
        say(f"silent dropout: {silent.parties} SuperNodes, one SIGKILLed mid-round")
        with tempfile.TemporaryDirectory(prefix="fedge-secagg-silent-") as tmp:
            result = run_silent_dropout(Path(tmp), silent, say)
        silent_figures = {**silent_verdict(result, silent), "silent": "flower-superlink"}
    seconds = statistics.median(secure_s)
    plain_seconds = statistics.median(plain_s)
    bound = survivors_bound(sent, list(range(parties)), settings)
    survived_ok = dropout["completed"] and dropout["error"] <= dropout["bound"]
    return {
        "benchmark": "secagg",
        "machine": machine_info(),
        "parties": parties,
        "params": params,
        "rounds": rounds,
        "seconds_per_round": round(seconds, 4),
        "plain_seconds_per_round": round(plain_seconds, 4),
        "ratio": round(seconds / plain_seconds, 3) if plain_seconds else None,
        "max_abs_error": max(errors),
        "error_bound": bound,
        "within_bound": max(errors) <= bound,
        "dropouts_survived": int(survived_ok),
        "dropout_max_abs_error": dropout["error"],
        "secagg": {
            "reconstruction_threshold": settings.reconstruction_threshold,
            "clipping_range": settings.clipping_range,
            "quantization_range": settings.quantization_range,
            "max_weight": settings.max_weight,
        },
        "seconds_per_round_each": [round(s, 4) for s in secure_s],
        "plain_seconds_per_round_each": [round(s, 4) for s in plain_s],
        "runtime": "flwr.simulation (Ray)",
        "ray_cpus": num_cpus,
        **silent_figures,
    }


def _wait_for_nodes(grid: Grid, count: int) -> None:
    if wait_for_nodes(grid, count, NODE_WAIT_S, poll_s=0.2) < count:
        raise RuntimeError(f"fewer than {count} parties joined within {NODE_WAIT_S:.0f} s")


def _max_abs_difference(a: ArrayRecord, b: ArrayRecord) -> float:
    return max(
        float(np.abs(a[k].numpy().astype(np.float64) - b[k].numpy().astype(np.float64)).max())
        for k in a
    )

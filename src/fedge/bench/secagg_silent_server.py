"""The ServerApp of the silent-dropout round (:mod:`fedge.bench.secagg_silent`).

Runs on a real SuperLink, over real SuperNodes running :data:`fedge.bench.secagg_apps.secagg_app`:

1. a clean SecAgg+ round, every party asked and every party answering (its time is the
   baseline the silent round is compared with);
2. the silent round: the round config names ``drop-partition`` with ``drop-stage =
   "silent"``, so that party takes part in SecAgg+'s key stages, then hangs before its
   masked vector and the harness SIGKILLs its SuperNode. Nothing is ever sent for it.

Each stage's wait is timed on the grid the protocol talks to (:class:`StageTimer`). The
result -- times, the stage limits, the unmasked model's largest difference from the
weighted mean of the survivors' updates and the quantisation bound, and the round's
record -- is written as JSON to the run config's ``out``, or ``{"error": ...}``.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.serverapp import Grid, ServerApp

from fedge.aggregator.fleet.grids import NODE_ID_BASE, WrappedGrid, wait_for_nodes
from fedge.aggregator.fleet.identity import PartitionOrderedGrid
from fedge.aggregator.privacy.secagg import SecAggSettings, quantization_error_bound, run_secagg
from fedge.aggregator.privacy.secagg_round import stage_of
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.bench.secagg_apps import (
    BASE_EXAMPLES,
    DROP_PARTITION,
    DROP_STAGE,
    SILENT,
    examples_of,
    party_update,
)
from fedge.bench.sim_overhead_apps import initial_arrays

NODE_WAIT_S = 120.0
# Every party's weight n / max_weight stays <= 1, so no update is clipped (|values| < 8).
MAX_WEIGHT = float(BASE_EXAMPLES + 4 + 4)

silent_server = ServerApp()


class StageTimer(WrappedGrid):
    """Forwards everything; notes how long each SecAgg+ stage waited, per round."""

    def __init__(self, inner: Grid) -> None:
        super().__init__(inner)
        self.waited_s: list[tuple[str, float]] = []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        sent = list(messages)
        started = time.monotonic()
        replies = list(self.inner.send_and_receive(sent, timeout=timeout))
        self.waited_s.append((stage_of(sent), time.monotonic() - started))
        return replies


@silent_server.main()
def _main(grid: Grid, context: Context) -> None:
    config = context.run_config
    out = Path(str(config["out"]))
    try:
        result = silent_rounds(
            grid,
            parties=int(config["parties"]),
            params=int(config["params"]),
            dropped=int(config["dropped"]),
            seed=int(config["seed"]),
            collect_timeout_s=float(config["collect-timeout-s"]),
            key_stage_timeout_s=float(config["key-stage-timeout-s"]),
        )
    except Exception as exc:  # the harness reports it; the run must still say why
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out)


def silent_rounds(
    grid: Grid,
    *,
    parties: int,
    params: int,
    dropped: int,
    seed: int,
    collect_timeout_s: float,
    key_stage_timeout_s: float,
) -> dict[str, Any]:
    """A clean SecAgg+ round, then one in which partition ``dropped`` dies silently."""
    ordered = PartitionOrderedGrid(grid)
    _wait_for_nodes(ordered, parties)
    settings = SecAggSettings(
        reconstruction_threshold=0.5,
        max_weight=MAX_WEIGHT,
        key_stage_timeout_s=key_stage_timeout_s,
    )
    records: list[RoundRecord] = []
    strategy = StreamingFedAvg(per_round=parties, seed=seed)
    strategy.observers.append(records.append)
    timers: list[StageTimer] = []

    def timed(wire: Grid) -> Grid:
        timers.append(StageTimer(wire))
        return timers[-1]

    arrays = initial_arrays(params, seed)
    started = time.monotonic()
    clean = run_secagg(
        ordered, strategy, arrays, settings, num_rounds=1, timeout=collect_timeout_s,
        recorder=timed,
    ).arrays  # fmt: skip
    clean_s = time.monotonic() - started
    if clean is None:
        raise RuntimeError("the clean SecAgg+ round produced no model")
    killed = ConfigRecord({DROP_PARTITION: dropped, DROP_STAGE: SILENT})
    started = time.monotonic()
    survived = run_secagg(
        ordered, strategy, clean, settings, num_rounds=2, first_round=2,
        train_config=killed, timeout=collect_timeout_s, recorder=timed,
    ).arrays  # fmt: skip
    silent_s = time.monotonic() - started
    if survived is None:
        raise RuntimeError("the silent round produced no model")
    sent = {k: a.numpy() for k, a in clean.items()}
    rest = [p for p in range(parties) if p != dropped]
    expected = weighted_mean(sent, rest)
    error = max(
        float(np.abs(survived[k].numpy().astype(np.float64) - expected[k]).max()) for k in expected
    )
    record = records[-1]
    return {
        "clean_round_s": clean_s,
        "silent_round_s": silent_s,
        "clean_stages_s": dict(timers[0].waited_s),
        "silent_stages_s": dict(timers[-1].waited_s),
        "max_abs_error": error,
        "error_bound": survivors_bound(sent, rest, settings),
        "on_time": [node - NODE_ID_BASE for node in record.on_time],
        "late": [node - NODE_ID_BASE for node in record.late],
        "failed": [node - NODE_ID_BASE for node in record.failed],
        "failures": {str(node - NODE_ID_BASE): why for node, why in record.failures.items()},
        "clean_on_time": [node - NODE_ID_BASE for node in records[0].on_time],
    }


def _wait_for_nodes(grid: Grid, count: int) -> None:
    if wait_for_nodes(grid, count, NODE_WAIT_S, poll_s=0.2) < count:
        raise RuntimeError(f"fewer than {count} SuperNodes joined within {NODE_WAIT_S:.0f} s")


def weighted_mean(sent: dict[str, np.ndarray], partitions: list[int]) -> dict[str, np.ndarray]:
    """The plain weighted mean of these partitions' updates to ``sent`` (float64)."""
    weights = [float(examples_of(p)) for p in partitions]
    total = sum(weights)
    mean = {k: np.zeros(v.shape, np.float64) for k, v in sent.items()}
    for weight, partition in zip(weights, partitions, strict=True):
        for k, v in party_update(sent, partition).items():
            mean[k] += weight / total * v
    return mean


def survivors_bound(
    sent: dict[str, np.ndarray], partitions: list[int], settings: SecAggSettings
) -> float:
    """SecAgg+'s quantisation bound for these partitions' updates to ``sent``."""
    # The updates are the model plus offsets of ~0.01: 0.1 covers the largest offset.
    largest = max(float(np.abs(v).max()) for v in sent.values()) + 0.1
    return quantization_error_bound(
        [examples_of(p) for p in partitions],
        largest,
        clipping_range=settings.clipping_range,
        quantization_range=settings.quantization_range,
        max_weight=settings.max_weight,
    )

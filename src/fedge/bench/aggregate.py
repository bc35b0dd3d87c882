"""Aggregation memory: fedge's streaming fold against Flower's FedAvg on the same replies.

One training round of ``updates`` parties, each replying with a Flower ``Message`` whose
content is an ``ArrayRecord`` of a ``params``-parameter float32 model (six arrays holding
40 %, 25 %, 15 %, 10 %, 6 % and 4 % of the parameters, as a small network's layers would)
and a ``MetricRecord`` with ``num-examples``. Replies are generated deterministically
(seeded per party) one at a time, when a pull asks for them -- they *arrive* one by one --
by :class:`ReplyGrid`, a Flower ``Grid`` that stands in for the SuperLink. Each side runs
its own round code unchanged against that grid:

- ours: :meth:`StreamingFedAvg.run_round` (wall clock, no deadline, quorum = everyone):
  ``collect.ReplyStream`` pulls, folds each reply into a :class:`StreamingMean` and
  releases its ``ArrayRecord``, then ``to_array_record(fold.result())``;
- Flower: what ``Strategy.start`` does in a round -- ``FedAvg.configure_train``,
  ``grid.send_and_receive`` (returns once every reply is in: the list holds all of them),
  ``FedAvg.aggregate_train`` (validation, then ``aggregate_arrayrecords`` on the list);
- fold (diagnostic, :func:`_fold_round`): ours' pull-fold-release loop with the reply's
  record read as ``content[key]`` -- what :class:`StreamingMean` achieves when a reply is
  really released (``RecordDict.array_records`` views are reference cycles, see there).

Each side runs in a fresh child process (``python -m fedge.bench.aggregate child ...``),
so no side's heap colours another's peak. In the child (see :func:`run_side`):
imports, a tiny warm-up round through the same code path, the global model (held by every
side alike), ``gc.collect()`` and ``malloc_trim(0)``; then the peak is reset and the
baseline taken; the round runs; the peak is read before anything else allocates.

Memory is the process's resident set from the kernel, not an allocator's view: peak =
``VmHWM`` after the round - ``VmRSS`` at the baseline, reported in model sizes
(``params * 4`` bytes). Time: the round's wall time minus the time the grid spent
generating replies (the same work on both sides), so it is receive + aggregate. Agreement:
the two results' max absolute difference, against a float32 worst-case bound, and each
result's error against a float64 mean computed in the parent from the same seeded updates.

The workload (model, updates, :class:`ReplyGrid`, the float64 reference) is in
:mod:`fedge.bench.aggregate_workload`; reading and resetting resident memory in
:mod:`fedge.bench.aggregate_memory`. This module holds the sides, the parent and the
child-process entry.
"""

import argparse
import gc
import importlib.metadata
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.replies import arrays_of, to_array_record
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.bench import Progress, no_progress
from fedge.bench.aggregate_memory import (
    malloc_trim,
    mem_available_bytes,
    reset_peak_rss,
    status_kib,
)
from fedge.bench.aggregate_workload import (
    ARRAYRECORD_KEY,
    METRICRECORD_KEY,
    NUM_EXAMPLES,
    ReplyGrid,
    array_names,
    array_sizes,
    global_model,
    reference_mean,
)
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError

TARGET_PEAK_OVER_MODEL = 3.0
ROUND_TIMEOUT_S = 3600.0
CHILD_TIMEOUT_S = 7200.0
WARMUP = (2, 1000)  # updates, params of the warm-up round run before the baseline
SIDES = ("ours", "flower", "fold")


# ---------------------------------------------------------------- one side, in a child


def _round(
    side: str, grid: ReplyGrid, model: ArrayRecord, updates: int, seed: int
) -> tuple[ArrayRecord, int]:
    """One round of ``side`` against ``grid``; returns the new model and replies aggregated."""
    if side == "ours":
        strategy = StreamingFedAvg(
            per_round=updates, seed=seed, clock=ClockMode.WALL, pull_interval_s=0.0
        )
        arrays, record = strategy.run_round(1, model, ConfigRecord(), grid, ROUND_TIMEOUT_S)
        return arrays, len(record.on_time)
    if side == "fold":
        return _fold_round(grid, model)
    flower = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=updates,
        min_available_nodes=updates,
    )
    # Strategy.start, one round: configure, send and wait for all, aggregate.
    replies = grid.send_and_receive(
        flower.configure_train(1, model, ConfigRecord(), grid), timeout=ROUND_TIMEOUT_S
    )
    aggregated, _ = flower.aggregate_train(1, replies)
    if aggregated is None:
        raise BenchError("Flower's FedAvg aggregated nothing")
    return aggregated, len(list(replies))


def _fold_round(grid: ReplyGrid, model: ArrayRecord) -> tuple[ArrayRecord, int]:
    """The fold alone, on the same pulled replies: what ``collect.ReplyStream`` does, except
    that the record is read with ``content[key]``, not ``content.array_records[key]``.

    ``RecordDict.array_records`` builds a ``_SyncedDict`` view that is a reference cycle
    (its ``check_value`` bound method sits in its own ``__dict__``): the view, and the
    reply's ``ArrayRecord`` it holds, outlive the reply until the cyclic GC runs, so
    replacing the record in the reply does not free it. This side shows what
    :class:`StreamingMean` achieves when the reply is really released.
    """
    content = RecordDict({ARRAYRECORD_KEY: model, "config": ConfigRecord()})
    messages = [
        Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN)
        for node in grid.get_node_ids()
    ]
    fold = StreamingMean()
    folded = 0
    for message_id in list(grid.push_messages(messages)):
        for reply in grid.pull_messages([message_id]):
            record = reply.content[ARRAYRECORD_KEY]
            metrics = reply.content[METRICRECORD_KEY]
            if not isinstance(record, ArrayRecord) or not isinstance(metrics, MetricRecord):
                raise BenchError("a reply lacks its ArrayRecord or MetricRecord")
            weight = metrics[NUM_EXAMPLES]
            if not isinstance(weight, int | float):
                raise BenchError(f"a reply's {NUM_EXAMPLES} is not a number: {weight!r}")
            fold.add(arrays_of(record), float(weight))
            reply.content[ARRAYRECORD_KEY] = ArrayRecord()  # fold, then let the reply go
            del record
            folded += 1
    return to_array_record(fold.result()), folded


def run_side(side: str, updates: int, params: int, *, seed: int, out: Path) -> dict[str, Any]:
    """Child-process side: one measured round of ``side``; the result is saved to ``out``."""
    if side not in SIDES:
        raise BenchError(f"side must be one of {SIDES}, got {side!r}")
    random.seed(seed)  # FedAvg samples nodes with `random`
    sizes = array_sizes(params)
    model_bytes = params * np.dtype(np.float32).itemsize
    # Warm-up through the same code path: lazy imports, first-call caches, logging set-up.
    warm_updates, warm_params = WARMUP
    warm_sizes = array_sizes(warm_params)
    _round(
        side,
        ReplyGrid(warm_updates, warm_sizes, seed=seed),
        global_model(warm_sizes),
        warm_updates,
        seed,
    )
    grid = ReplyGrid(updates, sizes, seed=seed)
    model = global_model(sizes)  # the server's current model: both sides hold it
    gc.collect()
    malloc_trim()
    reset = reset_peak_rss()
    baseline_kib = status_kib("VmRSS")
    started = time.perf_counter()
    result, aggregated = _round(side, grid, model, updates, seed)
    wall_s = time.perf_counter() - started
    peak_kib = status_kib("VmHWM")  # read before anything else allocates
    rss_after_kib = status_kib("VmRSS")
    ru_maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    if aggregated != updates:
        raise BenchError(f"{side}: aggregated {aggregated} replies, expected {updates}")
    arrays: dict[str, Any] = {name: array.numpy() for name, array in result.items()}
    np.savez(out, **arrays)
    extra = (peak_kib - baseline_kib) * 1024
    return {
        "side": side,
        "updates": updates,
        "params": params,
        "peak_rss_over_model": round(extra / model_bytes, 3),
        "peak_rss_over_baseline_bytes": extra,
        "baseline_rss_bytes": baseline_kib * 1024,
        "peak_rss_bytes": peak_kib * 1024,
        "rss_after_bytes": rss_after_kib * 1024,
        "ru_maxrss_bytes": ru_maxrss_kib * 1024,
        "peak_reset": reset,
        "seconds": round(wall_s - grid.generate_s, 3),
        "generate_seconds": round(grid.generate_s, 3),
        "wall_seconds": round(wall_s, 3),
        "replies_generated": grid.replies_sent,
    }


# ---------------------------------------------------------------- the parent


def _run_child(side: str, updates: int, params: int, seed: int, out: Path) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "fedge.bench.aggregate", "child", side,
        "--updates", str(updates), "--params", str(params), "--seed", str(seed),
        "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=CHILD_TIMEOUT_S
    )
    if result.returncode != 0:
        raise BenchError(
            f"the {side} side failed (exit {result.returncode}): {result.stderr.strip()[-800:]}"
        )
    info: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return info


def run_aggregate(
    updates: int = 200,
    params: int = 10_000_000,
    *,
    seed: int = 0,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Ours vs Flower on the same ``updates`` replies of a ``params``-parameter model."""
    if updates < 1:
        raise BenchError(f"updates must be at least 1, got {updates}")
    sizes = array_sizes(params)
    names = array_names(len(sizes))
    model_bytes = params * np.dtype(np.float32).itemsize
    machine = machine_info()
    machine["versions"]["flwr"] = importlib.metadata.version("flwr")
    # Flower holds every reply (serialized) at once, plus its sum, a decoded array and its
    # scaled copy, and the result record: refuse rather than push the machine into swap.
    flower_need = (updates + 3) * model_bytes + (512 << 20)
    available = mem_available_bytes()
    if available is not None and flower_need > available:
        fits = max(0, (available - (512 << 20)) // model_bytes - 3)
        raise BenchError(
            f"Flower's side needs ~{flower_need / 2**30:.1f} GiB ({updates} replies of "
            f"{model_bytes / 2**20:.0f} MiB held at once) but {available / 2**30:.1f} GiB "
            f"is available: lower --updates (at most ~{fits} fit) or --params"
        )
    with tempfile.TemporaryDirectory(prefix="fedge-bench-aggregate-") as tmp:
        sides: dict[str, dict[str, Any]] = {}
        results: dict[str, dict[str, npt.NDArray[Any]]] = {}
        for side in SIDES:
            progress(f"{side}: {updates} replies x {params:,} params in a fresh process")
            out = Path(tmp) / f"{side}.npz"
            sides[side] = _run_child(side, updates, params, seed, out)
            with np.load(out) as saved:
                results[side] = {name: saved[name] for name in names}
    progress("float64 reference")
    reference, largest = reference_mean(updates, sizes, seed)
    ours, flower, fold = results["ours"], results["flower"], results["fold"]
    max_abs_diff = max(float(np.abs(ours[n] - flower[n]).max()) for n in names)
    fold_max_abs_diff = max(float(np.abs(fold[n] - flower[n]).max()) for n in names)
    errors = {
        side: max(
            float(np.abs(results[side][n].astype(np.float64) - ref).max())
            for n, ref in zip(names, reference, strict=True)
        )
        for side in SIDES
    }
    # Both sides sum `updates` float32 terms (ours w_i*x_i then / W, Flower x_i*(w_i/W)):
    # each is within updates * eps * max|x| of the exact mean, so they agree within twice it.
    tolerance = 2 * updates * float(np.finfo(np.float32).eps) * largest
    dtypes_ok = all(r[n].dtype == np.float32 for r in results.values() for n in names)
    agree = dtypes_ok and max(max_abs_diff, fold_max_abs_diff) <= tolerance
    peak = sides["ours"]["peak_rss_over_model"]
    flower_peak = sides["flower"]["peak_rss_over_model"]
    return {
        "benchmark": "aggregate",
        "updates": updates,
        "params": params,
        "array_sizes": sizes,
        "dtype": "float32",
        "model_bytes": model_bytes,
        "peak_rss_over_model": peak,
        "seconds": sides["ours"]["seconds"],
        "flower_peak_rss_over_model": flower_peak,
        "flower_seconds": sides["flower"]["seconds"],
        "fold_peak_rss_over_model": sides["fold"]["peak_rss_over_model"],
        "fold_seconds": sides["fold"]["seconds"],
        "memory_ratio": round(flower_peak / peak, 1) if peak > 0 else None,
        "max_abs_diff": max_abs_diff,
        "fold_max_abs_diff": fold_max_abs_diff,
        "tolerance": tolerance,
        "agree": agree,
        "max_abs_err_vs_float64": errors,
        "target_peak_rss_over_model": TARGET_PEAK_OVER_MODEL,
        "met_target": agree and peak <= TARGET_PEAK_OVER_MODEL,
        "ours": sides["ours"],
        "flower": sides["flower"],
        "fold": sides["fold"],
        "measured": (
            "each side in a fresh process: peak RSS = VmHWM after the round (reset via "
            "/proc/self/clear_refs) - VmRSS right before it, in model sizes (params * 4 B); "
            "seconds = round wall time - reply generation (receive + aggregate). ours: "
            "StreamingFedAvg.run_round (fold each reply as pulled, then release it); "
            "flower: FedAvg.configure_train + grid.send_and_receive (all replies) + "
            "FedAvg.aggregate_train (aggregate_arrayrecords); fold: ours' fold loop with "
            "the reply's record read as content[key] (no RecordDict.array_records view)"
        ),
        "machine": machine,
    }


# ---------------------------------------------------------------- child-process entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedge.bench.aggregate")
    sub = parser.add_subparsers(dest="command", required=True)
    child = sub.add_parser("child", help="one measured round of one side")
    child.add_argument("side", choices=SIDES)
    child.add_argument("--updates", type=int, required=True)
    child.add_argument("--params", type=int, required=True)
    child.add_argument("--seed", type=int, default=0)
    child.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    info = run_side(args.side, args.updates, args.params, seed=args.seed, out=args.out)
    print(json.dumps(info))


if __name__ == "__main__":
    main()

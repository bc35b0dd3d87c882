"""Cloud -> edge distillation: a small student from a large teacher, against FedAvg alone.

On one scenario and seed (``tifl-digits``, seed 0 by default):

- **teacher**: ``mlp-large`` trained *centrally* on the pooled training splits of all
  parties (:func:`fedge.students.edge.train_teacher`). It stands in for a federated
  teacher (a FedAvg'd ``mlp-large`` would score about the same or lower); the JSON says so.
- **student**: ``mlp-small`` distilled from it on the scenario's unlabeled proxy split and
  its one-pixel shifts (Hinton loss, T = 4; :func:`fedge.students.edge.distill_student`),
  then exported to ONNX and verified against torch on the proxy split.
- **student alone**: the same ``mlp-small`` trained by plain FedAvg over the scenario's
  parties with :func:`fedge.sim.runner.run_one` (in-process grid, the scenario's
  ``[training]`` recipe and rounds, only ``arch`` changed), no distillation. Reported:
  the final round's test accuracy (headline) and the best round's (an optimistic bound:
  picking it needs the test set).

All accuracies are on the scenario's held-out test split. Targets: >= 4x fewer parameters,
student within 1.5 points of the teacher, student above student-alone (final round).
:func:`run_distill_seeds` repeats it over seeds and reports the medians.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fedge.bench import Progress, no_progress
from fedge.bench.machine import machine_info
from fedge.sim.data import make_partitions
from fedge.sim.data import source as data_source
from fedge.sim.runner import run_one
from fedge.sim.scenario import load_scenario
from fedge.students import edge as edge_student

TARGET_COMPRESSION = 4.0
TARGET_GAP_POINTS = 1.5


def run_distill(
    scenario_name: str = "tifl-digits",
    seed: int = 0,
    *,
    rounds: int | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Teacher, distilled student and FedAvg-alone student on one scenario and seed."""
    scenario = load_scenario(scenario_name)
    started = time.perf_counter()

    progress(f"training teacher {edge_student.TEACHER_ARCH}")
    split = data_source(scenario, seed)
    teacher = edge_student.train_teacher(split)
    teacher_s = time.perf_counter() - started

    progress(f"distilling {edge_student.STUDENT_ARCH}")
    t0 = time.perf_counter()
    student, report = edge_student.distill_student(teacher, split)
    distill_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        check = edge_student.export_student(student, Path(tmp) / "student.onnx", split)

    alone_scenario = scenario.with_rounds(rounds or scenario.rounds_for("fedavg"))
    alone_scenario = dataclasses.replace(
        alone_scenario,
        training=dataclasses.replace(alone_scenario.training, arch=edge_student.STUDENT_ARCH),
    )
    progress(f"FedAvg {edge_student.STUDENT_ARCH}, {alone_scenario.training.rounds} rounds")
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.ERROR)
    t0 = time.perf_counter()
    try:
        curve = run_one(alone_scenario, "fedavg", seed)
    finally:
        flwr_logger.setLevel(level)
    fedavg_s = time.perf_counter() - t0

    alone = curve.final_accuracy
    gap_points = 100 * (report.teacher_accuracy - report.student_accuracy)
    checks = {
        "compression": report.compression >= TARGET_COMPRESSION,
        "within_teacher": gap_points <= TARGET_GAP_POINTS,
        "above_student_alone": report.student_accuracy > alone,
    }
    return {
        "benchmark": "distill",
        "scenario": scenario.name,
        "seed": seed,
        "teacher": report.teacher,
        "teacher_note": (
            "mlp-large trained centrally on the pooled party training splits: a stand-in "
            "for a federated teacher, not a FedAvg run"
        ),
        "teacher_arch": report.teacher_arch,
        "student_arch": report.student_arch,
        "teacher_params": report.teacher_params,
        "student_params": report.student_params,
        "compression": round(report.compression, 2),
        "teacher_accuracy": round(report.teacher_accuracy, 4),
        "student_accuracy": round(report.student_accuracy, 4),
        "student_init_accuracy": round(report.student_init_accuracy, 4),
        "student_alone_accuracy": round(alone, 4),
        "student_alone_best_round_accuracy": round(max(curve.accuracy), 4),
        "student_alone_note": (
            f"{report.student_arch} trained by FedAvg with run_one (in-process grid), "
            f"{alone_scenario.training.rounds} rounds, {scenario.fleet.per_round} of "
            f"{scenario.fleet.parties} parties per round, no distillation; final round "
            "(best round also given, it is chosen on the test set)"
        ),
        "gap_points": round(gap_points, 2),
        "proxy_samples": report.proxy_samples,
        "transfer_set": report.data,
        "test_samples": len(make_partitions(scenario, seed).test[1]),
        "temperature": report.temperature,
        "distill_epochs": edge_student.DISTILL_EPOCHS,
        "distill_loss_first_epoch": round(report.first_epoch_loss, 4),
        "distill_loss_last_epoch": round(report.last_epoch_loss, 4),
        "onnx_probs_max_abs_diff": check.probs_max_abs_diff,
        "onnx_logits_max_abs_diff": check.logits_max_abs_diff,
        "wall_s": {
            "teacher": round(teacher_s, 2),
            "distill": round(distill_s, 2),
            "fedavg_student_alone": round(fedavg_s, 2),
        },
        "targets": {
            "compression_min": TARGET_COMPRESSION,
            "gap_points_max": TARGET_GAP_POINTS,
            "student_above_alone": True,
        },
        "checks": checks,
        "met_target": all(checks.values()),
        "machine": machine_info(),
    }


def run_distill_seeds(
    scenario_name: str = "tifl-digits",
    seeds: int = 5,
    *,
    rounds: int | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """:func:`run_distill` on seeds ``0..seeds-1``: every run, and the medians over seeds."""
    runs = []
    for seed in range(seeds):
        runs.append(
            run_distill(
                scenario_name,
                seed,
                rounds=rounds,
                progress=_labelled(progress, f"seed {seed}"),
            )
        )
    keys = ("teacher_accuracy", "student_accuracy", "student_alone_accuracy", "gap_points")
    medians = {key: statistics.median(run[key] for run in runs) for key in keys}
    first = runs[0]
    above = [run["student_accuracy"] - run["student_alone_accuracy"] for run in runs]
    checks = {
        "compression": first["compression"] >= TARGET_COMPRESSION,
        "within_teacher": medians["gap_points"] <= TARGET_GAP_POINTS,
        "above_student_alone": medians["student_accuracy"] > medians["student_alone_accuracy"],
    }
    return {
        "benchmark": "distill",
        "scenario": first["scenario"],
        "seeds": list(range(seeds)),
        "teacher_params": first["teacher_params"],
        "student_params": first["student_params"],
        "compression": first["compression"],
        **{key: round(value, 4) for key, value in medians.items()},
        "statistic": "median over seeds",
        "student_minus_alone_points": [round(100 * d, 2) for d in above],
        "seeds_student_above_alone": sum(d > 0 for d in above),
        "seeds_student_tied_with_alone": sum(d == 0 for d in above),
        "per_seed": runs,
        "checks": checks,
        "met_target": all(checks.values()),
        "machine": first["machine"],
    }


def _labelled(progress: Progress, label: str) -> Progress:
    return lambda line: progress(f"{label}: {line}")

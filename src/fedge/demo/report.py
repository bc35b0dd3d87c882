"""The demo's report: tables on the console, ``report.md``, ``summary.json`` and plots."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedge.demo import anomaly, closed_loop, privacy, security
from fedge.demo.learning import DENT_STATIONS, plot, report_lines
from fedge.demo.state import EDGES, IMAGES_PER_EDGE, MODEL, FleetRun
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.reports import store as report_store
from fedge.edge_manager.store import Store


def _model_rows(fleet: Fleet, store: Store, run: FleetRun) -> list[dict[str, Any]]:
    """Per model version: size, held-out accuracy, and what the stations did with it.

    Every prediction record carries the model version that served it, so the served
    counts and the label agreement are split by that column, not by time. A label agrees
    with "reject" when it names one of the model's defect classes (as in
    ``Fleet.label_agreement``, which splits by edge instead).
    """
    from fedge.models.digits import count_parameters

    student = run.student
    assert student is not None, "the student is distilled before the report"
    rows = []
    for version in (1, 2):
        manifest = fleet.registry.get(MODEL, version).manifest
        served = report_store.prediction_count(store, model=manifest.ref)
        labelled = report_store.labelled_decisions(store, manifest.ref)
        positives = set(manifest.positive_classes)
        agree = sum((r.decision == "reject") == (r.label in positives) for r in labelled)
        is_teacher = version == 1
        rows.append(
            {
                "model": manifest.ref,
                "role": "teacher" if is_teacher else f"student of {student.teacher}",
                "parameters": (
                    count_parameters(run.teacher.model) if is_teacher else student.student_params
                ),
                "held_out_accuracy": (
                    run.teacher.accuracy if is_teacher else student.student_accuracy
                ),
                "predictions": served,
                "labels": len(labelled),
                "label_agreement": agree / len(labelled) if labelled else None,
                "deploy_s": run.deploy_s[manifest.ref],
            }
        )
    return rows


def _edge_rows(fleet: Fleet) -> list[dict[str, Any]]:
    rows = []
    for edge in EDGES:
        view = fleet.show(edge)
        desired = view.desired_config or {}
        rows.append(
            {
                "edge": edge,
                "serving": view.serving,
                "config": f"v{view.desired_config_version}/v{view.config_applied}",
                "threshold": desired.get("default_threshold", 0.5),
                "predictions": view.predictions,
                "rejects": view.rejects,
                "agreement": view.label_agreement,
            }
        )
    return rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def write_report(out: Path, fleet: Fleet, store: Store, run: FleetRun, console: Console) -> int:
    student = run.student
    assert student is not None, "the student is distilled before the report"
    edges = _edge_rows(fleet)
    models = _model_rows(fleet, store, run)
    edge_table = Table("edge", "serving", "config", "threshold", "predictions", "rejects",
                       "agreement", title="stations (both batches)")  # fmt: skip
    for row in edges:
        edge_table.add_row(*(_percent(v) if k == "agreement" else str(v) for k, v in row.items()))
    # Short headers: the table must fit an 80-column terminal.
    model_table = Table("model", "role", "params", "held-out", "served", "agreement", "deploy",
                        title="model versions (held-out accuracy; label agreement)")  # fmt: skip
    for row in models:
        model_table.add_row(
            row["model"], str(row["role"]).split(" ")[0], str(row["parameters"]),
            f"{row['held_out_accuracy']:.3f}", str(row["predictions"]),
            _percent(row["label_agreement"]), f"{row['deploy_s']:.2f}s",
        )  # fmt: skip
    console.print(edge_table, model_table)
    _plot(out / "demo.png", store, run.truth)
    lineage = fleet.registry.get(MODEL, 2).manifest.lineage
    teacher_ref, student_ref = models[0]["model"], models[1]["model"]
    report = out / "report.md"
    report.write_text(
        "\n".join(
            [
                "# fedge demo report",
                "",
                f"- model {teacher_ref}, held-out accuracy after training: "
                f"{run.teacher.accuracy:.3f} ({student.held_out_samples} generated images)",
                f"- deployment of {teacher_ref} to {len(EDGES)} edges (download, verify, smoke "
                f"test, swap): {run.deploy_s[teacher_ref]:.2f} s",
                f"- threshold push to st-01 until reported applied: {run.push_s:.3f} s",
                f"- thumbnails at the manager by station: {run.thumbnails} (only st-01's "
                "config shares them, of rejected images; every other image stayed on its "
                "station)",
                f"- student {student_ref} distilled from {teacher_ref} (Hinton et al. 2015, "
                f"T={student.temperature:g}) on {student.data} in {run.distill_s:.1f} s: "
                f"{student.student_params} parameters vs {student.teacher_params} "
                f"({student.compression:.1f}x fewer), held-out accuracy "
                f"{student.student_accuracy:.3f} vs {student.teacher_accuracy:.3f} "
                f"(before distillation {student.student_init_accuracy:.3f}), "
                f"ONNX Runtime vs torch max |diff| {student.export_max_abs_diff:.1e}",
                f"- lineage of {student_ref}: parent version {lineage.parent_version}, run "
                f"{lineage.run_id}, data {lineage.data!r}, note {lineage.note!r}",
                f"- deployment of {student_ref} to {len(EDGES)} edges: "
                f"{run.deploy_s[student_ref]:.2f} s",
                "",
                "## Model versions",
                "",
                "Predictions and labels are split by the model version each prediction record "
                f"carries: every station scored {IMAGES_PER_EDGE} images with each version.",
                "",
                "| model | role | parameters | held-out accuracy | predictions served "
                "| label agreement | deploy |",
                "|---|---|---|---|---|---|---|",
                *(
                    f"| {r['model']} | {r['role']} | {r['parameters']} | "
                    f"{r['held_out_accuracy']:.3f} | {r['predictions']} | "
                    f"{_percent(r['label_agreement'])} | {r['deploy_s']:.2f} s |"
                    for r in models
                ),
                "",
                "## Stations",
                "",
                "| edge | serving | config desired/applied | threshold | predictions | rejects "
                "| label agreement |",
                "|---|---|---|---|---|---|---|",
                *(
                    f"| {r['edge']} | {r['serving']} | {r['config']} | {r['threshold']} | "
                    f"{r['predictions']} | {r['rejects']} | {_percent(r['agreement'])} |"
                    for r in edges
                ),
                "",
                "![scores](demo.png)",
                "",
                *([] if run.anomaly is None else anomaly.report_lines(run.anomaly)),
                *([] if run.learning is None else report_lines(run.learning)),
                *([] if run.closed_loop is None else closed_loop.report_lines(run.closed_loop)),
                *([] if run.privacy is None else privacy.report_lines(run.privacy)),
                *([] if run.security is None else security.report_lines(run.security)),
            ]
        )
    )
    student_summary = dataclasses.asdict(student)
    student_summary["onnx_path"] = str(student.onnx_path)
    student_summary["compression"] = student.compression
    learning = None
    if run.learning is not None:
        plot(run.learning, out / "fleet-learning.png")
        learning = dataclasses.asdict(run.learning)
        learning["job_dir"] = str(run.learning.job_dir)
        learning["dent_stations"] = list(DENT_STATIONS)  # the drifted ones (self-check)
    if run.anomaly is not None:
        anomaly.plot(run.anomaly, out / "anomaly-scores.png")
    summary = {
        "anomaly": None if run.anomaly is None else anomaly.summary(run.anomaly),
        "learning": learning,
        "closed_loop": None if run.closed_loop is None else closed_loop.summary(run.closed_loop),
        "privacy": None if run.privacy is None else privacy.summary(run.privacy),
        "security": None if run.security is None else security.summary(run.security),
        "edges": edges,
        "models": models,
        "push_s": run.push_s,
        "thumbnails": run.thumbnails,
        "distill_s": run.distill_s,
        "student": student_summary,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"report: {report}\nplot:   {out / 'demo.png'}")
    return 0


def _plot(path: Path, store: Store, truth: dict[str, str]) -> None:
    """Scratch-score histograms: one row per model version, one column per station."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report_store.scored_predictions(store)
    models = sorted({r.model for r in rows if r.source in truth})
    fig, axes = plt.subplots(
        len(models), len(EDGES), figsize=(4 * len(EDGES), 3.2 * len(models)), sharey=True,
        squeeze=False,
    )  # fmt: skip
    for model, model_axes in zip(models, axes, strict=True):
        for ax, edge in zip(model_axes, EDGES, strict=True):
            mine = [r for r in rows if r.edge == edge and r.model == model and r.source in truth]
            for cls, colour in (("clean", "tab:green"), ("scratch", "tab:red")):
                scores = [json.loads(r.scores)["scratch"] for r in mine if truth[r.source] == cls]
                ax.hist(scores, bins=20, range=(0, 1), alpha=0.6, color=colour, label=cls)
            if mine:
                ax.axvline(mine[0].threshold, color="black", linestyle="--", label="threshold")
            ax.set_title(f"{edge}, {model}")
            ax.set_xlabel("scratch score")
        model_axes[0].set_ylabel("images")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

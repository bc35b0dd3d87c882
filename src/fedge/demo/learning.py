"""The demo's last fleet chapter: the fleet learns from its own stations.

Two stations start seeing a defect the central training data never showed (dents from
another press, see :func:`fedge.datasets.defects.make_defect_images`). Each station scores
its new parts through its local HTTP API, which keeps every image on the station, and an
operator labels them there. Training is switched on in every station's signed config,
so each agent starts a Flower SuperNode; a fleet job (:mod:`fedge.federation.fleet_job`)
then trains ``inspect:1`` across the stations on the fleet's SuperLink -- the cloud never
sees an image -- publishes the result with its lineage and deploys it. The report shows
every station's accuracy on its own held-out images before the job and after each round.
"""

from __future__ import annotations

import io
import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedge.aggregator.jobs.run_store import RunStore
from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.edge_manager.fleet.operations import Fleet, Pushed
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.reports import store as report_store
from fedge.edge_manager.store import Store
from fedge.federation import fleet_job
from fedge.federation.prepare import prepare
from fedge.federation.publish import publish
from fedge.protocols.config import TrainingPolicy

DENT_STATIONS = ("st-02", "st-03")
DENT_FRACTION = 0.8  # of the defective parts at those stations
LEARN_IMAGES = 200  # per station, scored and labelled before the job (a fifth held out)
CHECK_IMAGES = 60  # per station, scored after the new model is deployed
ROUNDS = 4
MODEL = "inspect"
JOB = """# Written by the demo: a federated job across the demo fleet's stations.
[job]
name = "fleet-learns"
rounds = {rounds}
seed = 0

[task]
model = "inspect:1"
lr = 0.003
local_epochs = 5
batch_size = 16

[strategy]
kind = "fedavg"       # three stations: every one trains every round

[federation]
backend = "fleet"
fleet = "{fleet}"
edges = "all"
node_wait_s = 300.0
round_timeout_s = 600.0
eval_timeout_s = 300.0
"""


@dataclass
class Learning:
    """What the chapter measured, for the report."""

    job_dir: Path
    published: str = ""
    job_s: float = 0.0
    # edge -> round -> accuracy on the station's own held-out images
    held_out: dict[str, dict[int, float]] = field(default_factory=dict)
    held_out_examples: dict[str, int] = field(default_factory=dict)
    trained_examples: dict[str, int] = field(default_factory=dict)
    # edge -> model ref -> share of the station's freshly scored parts decided right
    served: dict[str, dict[str, float]] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)


def post_json(url: str, body: bytes, content_type: str) -> dict[str, Any]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=30) as response:
        result: dict[str, Any] = json.loads(response.read())
    return result


def config_applied(store: Store, pushed: Pushed) -> bool:
    """Whether the agent reported the pushed config version applied."""
    row = report_store.edge_state(store, pushed.edge)
    return row is not None and row.config_applied == pushed.version


def enable_training(fleet: Fleet, store: Store, edges: list[str], wait: Any) -> None:
    """Training on in every station's signed config (each agent then runs a SuperNode),
    waited for until each agent reports it applied: a fleet job needs them all."""
    pushed = fleet.set_training(edges, TrainingPolicy(enabled=True, max_minutes=5, threads=1))
    for p in pushed:
        wait(lambda p=p: config_applied(store, p), 30, f"training enabled on {p.edge}")


def _serving(store: Store, edge: str) -> str | None:
    """The model ``edge`` serves, as the manager records it (None: not enrolled)."""
    row = report_store.edge_state(store, edge)
    return None if row is None else row.serving


def score_at_station(
    port: int, images: np.ndarray, labels: np.ndarray, *, label: bool
) -> tuple[str, float]:
    """Score parts through the station's API (and label them there); (model, accuracy)."""
    right, model = 0, ""
    for image, truth in zip(images, labels, strict=True):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        record = post_json(f"http://127.0.0.1:{port}/v1/score", buffer.getvalue(), "image/png")
        model = str(record["model"])
        right += (record["decision"] == "reject") == (int(truth) == 1)
        if label:
            body = {
                "prediction_id": record["prediction_id"],
                "label": CLASSES[int(truth)],
                "who": "demo-operator",
            }
            post_json(
                f"http://127.0.0.1:{port}/v1/labels", json.dumps(body).encode(), "application/json"
            )
    return model, right / len(labels)


def run_learning(
    out: Path,
    home: ManagerHome,
    fleet: Fleet,
    store: Store,
    ports: dict[str, int],
    console: Console,
    wait: Any,
) -> Learning:
    """The chapter; ``wait(predicate, timeout_s, what)`` is the demo's poller."""
    edges = sorted(ports)
    result = Learning(out / "fleet-job")
    console.rule("[bold]the fleet learns: stations train on their own labelled images")
    console.print(
        f"{', '.join(DENT_STATIONS)} now see dents ({DENT_FRACTION:.0%} of their defects), "
        "a defect shape the central training data never showed"
    )
    with Progress(console=console) as progress:
        task = progress.add_task("stations score and operators label", total=len(edges))
        for index, edge in enumerate(edges):
            dents = DENT_FRACTION if edge in DENT_STATIONS else 0.0
            images, labels = make_defect_images(LEARN_IMAGES, seed=300 + index, dent_fraction=dents)
            ref, accuracy = score_at_station(ports[edge], images, labels, label=True)
            result.served.setdefault(edge, {})[ref] = accuracy
            progress.advance(task)

    enable_training(fleet, store, edges, wait)
    console.print("training enabled in every station's signed config: each agent runs a SuperNode")

    manifest = out / "fleet-job.toml"
    manifest.write_text(JOB.format(rounds=ROUNDS, fleet=fleet.fleet), encoding="utf-8")
    started = time.monotonic()
    prepare(manifest, result.job_dir, home)
    fleet_job.submit_to_fleet(result.job_dir, home)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rounds  held-out acc {task.fields[accuracy]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("federated job on the SuperLink", total=ROUNDS, accuracy="-")

        def show(done: int, total: int, accuracy: float | None) -> None:
            shown = "-" if accuracy is None else f"{accuracy:.3f}"
            progress.update(task, completed=done, total=total, accuracy=shown)

        ended = fleet_job.wait(result.job_dir, progress=show, timeout_s=1800)
    if ended.state.value != "completed":
        raise RuntimeError(f"demo: the fleet job ended {ended.state.value}: {ended.error}")
    result.published = publish(result.job_dir, home)
    result.job_s = time.monotonic() - started
    _read_run_store(result)
    lineage = fleet.registry.get(MODEL, int(result.published.split(":")[1])).manifest.lineage
    console.print(
        f"published {result.published} in {result.job_s:.0f}s (parent {MODEL}:"
        f"{lineage.parent_version}, run {lineage.run_id}, {lineage.data})",
        highlight=False,
    )

    deployment = fleet.deploy(MODEL, int(result.published.split(":")[1]), edges)
    wait(
        lambda: all(_serving(store, e) == result.published for e in edges),
        60,
        f"deployment {deployment} of {result.published}",
    )
    for index, edge in enumerate(edges):
        dents = DENT_FRACTION if edge in DENT_STATIONS else 0.0
        images, labels = make_defect_images(CHECK_IMAGES, seed=400 + index, dent_fraction=dents)
        ref, accuracy = score_at_station(ports[edge], images, labels, label=False)
        result.served[edge][ref] = accuracy
    _print(result, console)
    return result


def _read_run_store(result: Learning) -> None:
    store = RunStore(result.job_dir / "runs.db")
    try:
        run_id = str(store.runs()[-1]["run_id"])
        for row in store.evaluations(run_id):
            if row["accuracy"] is not None:
                result.held_out.setdefault(row["party"], {})[int(row["round"])] = float(
                    row["accuracy"]
                )
                result.held_out_examples[row["party"]] = int(row["examples"])
        names = store.party_names(run_id)
        for row in store.party_metrics(run_id):
            result.trained_examples[names[int(row["party"])]] = int(row["metrics"]["num-examples"])
        result.rounds = [
            {
                "round": r["round"],
                "on_time": [names.get(p, str(p)) for p in r["on_time"]],
                "round_time_s": r["round_time_s"],
                "accuracy": r["eval_metrics"].get("accuracy"),
            }
            for r in store.rounds(run_id)
        ]
    finally:
        store.close()


def _print(result: Learning, console: Console) -> None:
    table = Table("station", "trained on", "held-out", "before", "after", "change",
                  title="each station's own held-out images (federated evaluation)")  # fmt: skip
    for edge, by_round in sorted(result.held_out.items()):
        before, after = by_round.get(0), by_round.get(max(by_round))
        change = "-" if before is None or after is None else f"{(after - before) * 100:+.1f} pt"
        table.add_row(
            edge, str(result.trained_examples.get(edge, 0)), str(result.held_out_examples[edge]),
            f"{before:.3f}" if before is not None else "-",
            f"{after:.3f}" if after is not None else "-",
            change,
        )  # fmt: skip
    console.print(table)


def report_lines(result: Learning) -> list[str]:
    """The chapter's Markdown section."""
    lines = [
        "## The fleet learns",
        "",
        f"Stations {', '.join(DENT_STATIONS)} started seeing dents ({DENT_FRACTION:.0%} of "
        "their defective parts), a defect shape the central training data never showed. "
        f"Every station scored {LEARN_IMAGES} new parts through its local API and an "
        "operator labelled them there; the images never left the stations. A federated "
        f"job (FedAvg, {ROUNDS} rounds, every station a Flower SuperNode supervised by its "
        f"agent) trained {MODEL}:1 on them and published {result.published} "
        f'in {result.job_s:.0f} s. "Trained on" also counts the parts each station scored '
        "earlier in the demo, which operators labelled at the manager: the manager's "
        "labels travel down to the station that scored the image.",
        "",
        "Accuracy on each station's own held-out images (20 % of its labelled parts, "
        "never trained on), measured by the station itself:",
        "",
        "| station | trained on | held-out | "
        + " | ".join(f"round {r}" for r in range(ROUNDS + 1))
        + " | change |",
        "|---|---|---|" + "---|" * (ROUNDS + 2),
    ]
    for edge, by_round in sorted(result.held_out.items()):
        cells = [f"{by_round[r]:.3f}" if r in by_round else "-" for r in range(ROUNDS + 1)]
        change = "-"
        if 0 in by_round and ROUNDS in by_round:
            change = f"{(by_round[ROUNDS] - by_round[0]) * 100:+.1f} pt"
        lines.append(
            f"| {edge} | {result.trained_examples.get(edge, 0)} | "
            f"{result.held_out_examples.get(edge, 0)} | " + " | ".join(cells) + f" | {change} |"
        )
    lines += [
        "",
        "Decisions on freshly scored parts (share decided right), by the model serving:",
        "",
        *decided_right_lines(result.served),
        "",
        "![held-out accuracy per round](fleet-learning.png)",
        "",
    ]
    return lines


def decided_right_lines(by_edge: dict[str, dict[str, float]]) -> list[str]:
    """A Markdown table: per station and model, the share of fresh parts decided right."""
    lines = ["| station | model | decided right |", "|---|---|---|"]
    for edge, by_model in sorted(by_edge.items()):
        lines += [f"| {edge} | {ref} | {right:.3f} |" for ref, right in by_model.items()]
    return lines


def plot(result: Learning, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for edge, by_round in sorted(result.held_out.items()):
        rounds = sorted(by_round)
        style = "-o" if edge in DENT_STATIONS else "--s"
        ax.plot(rounds, [by_round[r] for r in rounds], style, label=edge)
    ax.set_xlabel("round (0: the starting model)")
    ax.set_ylabel("accuracy on own held-out images")
    ax.set_title("the fleet learns: each station's held-out accuracy")
    ax.set_xticks(range(ROUNDS + 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

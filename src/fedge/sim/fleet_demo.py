"""``make demo``: a whole inspection fleet on this machine, end to end.

Its own Mosquitto (per-edge accounts and ACLs), the manager, three edge agents as
separate processes; a CNN trained on generated scratch/clean surfaces, published, signed
and deployed; one station's threshold pushed; images scored at every station; operator
labels; a Markdown report and a PNG plot at the end.
"""

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fedge.edge_manager.enrollment import enroll, managed_broker
from fedge.edge_manager.fleet import Fleet
from fedge.edge_manager.home import ManagerHome, ManagerSettings
from fedge.edge_manager.registry import Registry
from fedge.edge_manager.store import Store
from fedge.sim.defects import CLASSES, make_defect_images, write_png_dir
from fedge.sim.processes import FedgeProcess
from fedge.transport.broker import free_port

EDGES = ("st-01", "st-02", "st-03")
IMAGES_PER_EDGE = 40
console = Console()


@dataclass(frozen=True)
class DemoResult:
    threshold_push_s: float
    deploy_s: float
    accuracy: dict[str, float]
    rows: list[dict[str, object]]


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    raise TimeoutError(f"demo: {what} did not happen within {timeout_s}s")


def _train_model(out: Path) -> tuple[Path, float]:
    from fedge.models.inspection import evaluate, export_onnx, train_inspection_model

    images, labels = make_defect_images(3000, seed=1)
    test_images, test_labels = make_defect_images(500, seed=2)
    model = train_inspection_model(images, labels, epochs=8, seed=0)
    accuracy = evaluate(model, test_images, test_labels)
    path = out / "inspect-v1.onnx"
    export_onnx(model, path)
    return path, accuracy


def run_demo(out: Path) -> int:
    out = out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    home = ManagerHome(out / "manager")
    home.init(ManagerSettings("plant-a", broker_port=free_port(), grpc_port=free_port()))
    store = Store(home.db_path)
    key = home.signing_key()
    fleet = Fleet(store, "plant-a", key, Registry(store, home.artifacts, key), "")
    fleet.grpc_target = home.settings().grpc_target
    configs = {}
    for edge in EDGES:
        path = out / edge / "agent.toml"
        path.parent.mkdir(parents=True)
        path.write_text(enroll(home, fleet, edge, out / edge / "data"))
        path.chmod(0o600)
        configs[edge] = path

    console.rule("[bold]fedge demo: an inspection fleet on one machine")
    with console.status("training the inspection CNN on generated surfaces (torch)…"):
        model_path, trained_accuracy = _train_model(out)
    console.print(f"trained: held-out accuracy {trained_accuracy:.3f}; exported {model_path.name}")
    published = fleet.registry.publish(
        model_path, name="inspect", version=1, classes=CLASSES, positive_classes=("scratch",)
    )
    console.print(f"published {published.manifest.ref} (sha256 {published.manifest.sha256[:12]}…)")

    broker = managed_broker(home)
    broker.start()
    env = {"FEDGE_HOME": str(home.root)}
    processes = [FedgeProcess(["manager", "serve"], out / "logs" / "manager.log", env).start()]
    processes += [
        FedgeProcess(
            ["agent", "run", "--config", str(configs[e])], out / "logs" / f"{e}.log"
        ).start()
        for e in EDGES
    ]
    try:
        status = _fleet_flow(out, home, fleet, store, trained_accuracy)
    finally:
        for process in processes:
            process.stop()
        broker.stop()
    return status or _federated_rounds(out)


def _federated_rounds(out: Path) -> int:
    """A short TiFL-vs-FedAvg simulation on the heterogeneous fleet (virtual time)."""
    import dataclasses
    import logging

    from fedge.sim.report import write_report
    from fedge.sim.runner import compare
    from fedge.sim.scenario import load_scenario

    logging.getLogger("flwr").setLevel(logging.WARNING)
    scenario = load_scenario("tifl-digits")
    scenario = dataclasses.replace(
        scenario, training=dataclasses.replace(scenario.training, rounds=120)
    )
    console.rule("[bold]federated rounds: tiered (TiFL) vs FedAvg, 50 simulated parties")
    with Progress(console=console) as progress:
        task = progress.add_task("simulating", total=2 * scenario.training.rounds)
        comparison = compare(
            scenario,
            ["fedavg", "tiered"],
            [0],
            progress=lambda label, r, total: progress.update(task, advance=1, description=label),
        )
    md, png, _ = write_report(comparison, out / "federated")
    for curve in comparison.curves:
        tta = curve.time_to_target_s
        console.print(
            f"{curve.strategy:>7}: final accuracy {curve.final_accuracy:.3f}, reached "
            f"{curve.target} after {'-' if tta is None else f'{tta:.0f}'} virtual s "
            f"({curve.times_s[-1]:.0f} s for {len(curve.times_s) - 1} rounds)"
        )
    console.print(f"federated report: {md}\nfederated plot:   {png}")
    return 0


def _edge_state(store: Store, edge: str) -> dict[str, object]:
    return store.one("SELECT * FROM edges WHERE edge=?", (edge,)) or {}


def _fleet_flow(
    out: Path, home: ManagerHome, fleet: Fleet, store: Store, trained_accuracy: float
) -> int:
    _wait(lambda: all(_edge_state(store, e).get("state") == "online" for e in EDGES), 30, "births")
    console.print(f"{len(EDGES)} agents online (birth after subscribe, last will registered)")

    deployment = fleet.deploy("inspect", 1, list(EDGES))
    deploy_s = _wait(
        lambda: all(_edge_state(store, e).get("deploy_stage") == "active" for e in EDGES),
        60,
        "deployment",
    )
    console.print(f"deployment {deployment}: inspect:1 active on all edges in {deploy_s:.2f}s")

    pushed = fleet.set_threshold(["st-01"], 0.72)[0]
    push_s = _wait(
        lambda: _edge_state(store, "st-01").get("config_applied") == pushed.version,
        10,
        "threshold report",
    )
    console.print(f"threshold 0.72 pushed to st-01 -> applied and reported in {push_s:.3f}s")

    truth: dict[str, str] = {}
    images, labels = make_defect_images(IMAGES_PER_EDGE * len(EDGES), seed=7)
    with Progress(console=console) as progress:
        task = progress.add_task("stations scoring images", total=len(images))
        for i, edge in enumerate(EDGES):
            chunk = slice(i * IMAGES_PER_EDGE, (i + 1) * IMAGES_PER_EDGE)
            paths = write_png_dir(images[chunk], out / "staging" / edge, prefix=f"{edge}-part")
            inbox = out / edge / "data" / "inbox"
            inbox.mkdir(parents=True, exist_ok=True)
            for path, label in zip(paths, labels[chunk], strict=True):
                truth[f"file:{path.name}"] = CLASSES[int(label)]
                path.replace(inbox / path.name)
        expected = len(images)
        while (stored := int(store.scalar("SELECT count(*) FROM predictions"))) < expected:
            progress.update(task, completed=stored)
            time.sleep(0.1)
        progress.update(task, completed=expected)

    # Operators label every prediction with the ground truth (the CruX labeler loop).
    for row in store.query("SELECT prediction_id, source FROM predictions"):
        fleet.add_label(row["prediction_id"], truth[row["source"]], "demo-operator")
    return _report(out, fleet, store, truth, trained_accuracy, push_s, deploy_s)


def _report(
    out: Path,
    fleet: Fleet,
    store: Store,
    truth: dict[str, str],
    trained_accuracy: float,
    push_s: float,
    deploy_s: float,
) -> int:
    table = Table("edge", "serving", "config", "threshold", "predictions", "rejects", "agreement")
    rows = []
    for edge in EDGES:
        view = fleet.show(edge)
        desired = view["desired_config"] or {}
        row = {
            "edge": edge,
            "serving": view["serving"],
            "config": f"v{view['desired_config_version']}/v{view['config_applied']}",
            "threshold": desired.get("default_threshold", 0.5),
            "predictions": view["predictions"],
            "rejects": view["rejects"],
            "agreement": view["label_agreement"],
        }
        rows.append(row)
        table.add_row(*(f"{v:.1%}" if k == "agreement" else str(v) for k, v in row.items()))
    console.print(table)
    _plot(out / "demo.png", store, truth)
    report = out / "report.md"
    report.write_text(
        "\n".join(
            [
                "# fedge demo report",
                "",
                f"- model inspect:1, held-out accuracy after training: {trained_accuracy:.3f}",
                f"- deployment to {len(EDGES)} edges (download, verify, smoke test, swap): "
                f"{deploy_s:.2f} s",
                f"- threshold push to st-01 until reported applied: {push_s:.3f} s",
                "",
                "| edge | serving | config desired/applied | threshold | predictions | rejects "
                "| label agreement |",
                "|---|---|---|---|---|---|---|",
                *(
                    f"| {r['edge']} | {r['serving']} | {r['config']} | {r['threshold']} | "
                    f"{r['predictions']} | {r['rejects']} | {float(r['agreement'] or 0):.1%} |"
                    for r in rows
                ),
                "",
                "![scores](demo.png)",
                "",
            ]
        )
    )
    (out / "summary.json").write_text(json.dumps({"edges": rows, "push_s": push_s}, indent=1))
    console.print(f"report: {report}\nplot:   {out / 'demo.png'}")
    return 0


def _plot(path: Path, store: Store, truth: dict[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = store.query("SELECT edge, scores, threshold, source FROM predictions")
    fig, axes = plt.subplots(1, len(EDGES), figsize=(4 * len(EDGES), 3.2), sharey=True)
    for ax, edge in zip(np.atleast_1d(axes), EDGES, strict=True):
        mine = [r for r in rows if r["edge"] == edge]
        for cls, colour in (("clean", "tab:green"), ("scratch", "tab:red")):
            scores = [json.loads(r["scores"])["scratch"] for r in mine if truth[r["source"]] == cls]
            ax.hist(scores, bins=20, range=(0, 1), alpha=0.6, color=colour, label=cls)
        if mine:
            ax.axvline(mine[0]["threshold"], color="black", linestyle="--", label="threshold")
        ax.set_title(edge)
        ax.set_xlabel("scratch score")
    np.atleast_1d(axes)[0].set_ylabel("images")
    np.atleast_1d(axes)[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

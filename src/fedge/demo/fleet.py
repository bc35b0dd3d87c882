"""``make demo``: a whole inspection fleet on this machine, end to end.

Its own Mosquitto (per-edge accounts and ACLs), the manager, three edge agents as
separate processes; a CNN trained on generated scratch/clean surfaces, published, signed
and deployed as ``inspect:1``; one station's threshold pushed; images scored at every
station; operator labels. Then the cloud -> edge step of KnowledgeNet: ``inspect:1`` is
distilled into a compact student on unlabeled generated surfaces (Hinton et al. 2015;
:mod:`fedge.students.inspection`), published as ``inspect:2`` with its lineage,
deployed to every station, and a fresh batch is scored and labelled. The Markdown report,
the PNG plot and ``summary.json`` compare the two versions by what the stations served.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from fedge.datasets.defects import CLASSES, make_defect_images, write_png_dir
from fedge.demo.anomaly import run_anomaly
from fedge.demo.checks import CheckResult
from fedge.demo.closed_loop import run_closed_loop
from fedge.demo.learning import run_learning
from fedge.demo.privacy import run_privacy
from fedge.demo.report import write_report
from fedge.demo.security import run_security
from fedge.demo.self_check import check_story, raise_if_failed, recording_errors
from fedge.demo.state import EDGES, IMAGES_PER_EDGE, MODEL, FleetRun, TrainedTeacher
from fedge.edge_manager.fleet.operations import Fleet, opened
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.registry.versions import TrainableSource
from fedge.edge_manager.reports import store as report_store
from fedge.edge_manager.security.enrollment import enroll, managed_broker
from fedge.edge_manager.security.superlink_access import KeySync, fleet_superlink
from fedge.edge_manager.store import Store
from fedge.protocols.manifest import Preprocess
from fedge.protocols.thumbnails import ThumbnailPolicy
from fedge.sim.processes import FedgeProcess
from fedge.transport.ports import free_port

# Seeds of the generated image sets; distinct, so no set overlaps another.
TRAIN_SEED, HELD_OUT_SEED, PROXY_SEED = 1, 2, 3
SCORE_SEEDS = {1: 7, 2: 8}  # model version -> the batch the stations score while serving it
TRAIN_IMAGES, HELD_OUT_IMAGES = 3000, 2000
IMAGE_SIZE = 32
SCORING_TIMEOUT_S = 120.0
console = Console()


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    raise TimeoutError(f"demo: {what} did not happen within {timeout_s}s")


def _train_teacher(out: Path) -> TrainedTeacher:
    from fedge.models.inspection import cpu_threads, evaluate, export_onnx, train_inspection_model
    from fedge.party.families import state_arrays, weights_bytes

    images, labels = make_defect_images(TRAIN_IMAGES, seed=TRAIN_SEED)
    held_out = make_defect_images(HELD_OUT_IMAGES, seed=HELD_OUT_SEED)
    # One thread: the demo's two cores are shared with the broker, the manager and the
    # agents, and these small CNNs train many times faster without OpenMP contention.
    with cpu_threads(1):
        model = train_inspection_model(images, labels, epochs=8, seed=0, device="cpu")
        accuracy = evaluate(model, *held_out)
    path = out / "inspect-v1.onnx"
    export_onnx(model, path)
    weights = out / "inspect-v1.npz"
    weights.write_bytes(weights_bytes(state_arrays(model)))
    return TrainedTeacher(model, path, weights, accuracy, held_out)


def run_demo(out: Path, *, console_port: int | None = None) -> int:
    """The whole demo; with ``console_port`` the operator console is served over the live
    fleet at the end (127.0.0.1) until Ctrl-C, before everything stops. It ends by
    checking its own story (``checks.py``): StoryCheckFailed if a chapter missed it."""
    with recording_errors() as own_errors:
        return _run_demo(out, console_port, own_errors.lines)


def _run_demo(out: Path, console_port: int | None, own_errors: list[str]) -> int:
    out = out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    home = ManagerHome(out / "manager")
    home.init(
        ManagerSettings(
            "plant-a",
            broker_port=free_port(),
            grpc_port=free_port(),
            superlink_port=free_port(),
            enroll_port=free_port(),
            metrics_port=free_port(),  # /metrics on 127.0.0.1, on a port of its own
            # The demo's stations score tens of parts, not thousands: judge drift on
            # windows of 40 and look every 2 s.
            monitor_interval_s=2.0,
            monitor_min_window=40,
        )
    )
    fleet = Fleet.open(home)
    store = fleet.store
    configs, ports = {}, {}
    for edge in EDGES:
        path = out / edge / "agent.toml"
        path.parent.mkdir(parents=True)
        ports[edge] = free_port()  # the station's local API (scoring, labels) on 127.0.0.1
        # The learning chapter trains without DP-SGD: the stations start without a privacy
        # floor (explicitly); the privacy chapter gives each its own floor before its job.
        text = enroll(home, fleet, edge, out / edge / "data", privacy_floor=False)
        # A new model's probation ends after 20 s (or 50 images): the stations score tens
        # of parts, and a staged rollout's waves wait for each station's verdict.
        text = text.replace("http_port = 0", f"http_port = {ports[edge]}\nprobation_s = 20.0")
        path.write_text(text)
        path.chmod(0o600)
        configs[edge] = path

    console.rule("[bold]fedge demo: an inspection fleet on one machine")
    with console.status("training the inspection CNN on generated surfaces (torch)…"):
        teacher = _train_teacher(out)
    console.print(
        f"trained: held-out accuracy {teacher.accuracy:.3f} on {HELD_OUT_IMAGES} images; "
        f"exported {teacher.onnx_path.name}"
    )
    published = fleet.registry.publish(
        teacher.onnx_path,
        name=MODEL,
        version=1,
        classes=CLASSES,
        positive_classes=("scratch",),
        # Trainable: the fleet's federated job starts from these weights.
        preprocess=Preprocess(image_size=IMAGE_SIZE),
        trainable=TrainableSource(teacher.weights_path, "inspection-cnn", {"width": 16}),
    )
    console.print(f"published {published.manifest.ref} (sha256 {published.manifest.sha256[:12]}…)")

    broker = managed_broker(home)
    broker.start()
    superlink = fleet_superlink(home)  # HTTPS; stations' SuperNode keys from certificates
    superlink.start()
    # The front's counters outlive it: read after the run (signed apps, issue 24).
    front: Counter[str] = Counter() if superlink.front is None else superlink.front.counters
    node_keys = KeySync(home, superlink)
    node_keys.start()
    env = {"FEDGE_HOME": str(home.root)}
    processes = [FedgeProcess(["manager", "serve"], out / "logs" / "manager.log", env).start()]
    processes += [
        FedgeProcess(
            ["agent", "run", "--config", str(configs[e])], out / "logs" / f"{e}.log"
        ).start()
        for e in EDGES
    ]
    federated: dict[str, Any] | None = None
    checked: list[CheckResult] = []
    try:
        run = FleetRun(teacher)
        status = _fleet_flow(out, fleet, store, run)
        if status == 0:
            run.anomaly = run_anomaly(out, home, fleet, store, ports, console, _wait)
            run.learning = run_learning(out, home, fleet, store, ports, console, _wait)
            run.closed_loop = run_closed_loop(out, home, fleet, store, ports, console, _wait)
            run.privacy = run_privacy(
                out, home, fleet, store, sorted(ports), run.learning.published, console, _wait
            )
            run.security = run_security(out, home, fleet, store, console, _wait)
            write_report(out, fleet, store, run, console)
            if console_port is not None:
                # The simulation first: the console is the demo's last step, ended by
                # Ctrl-C, and nothing should run on after the operator has stopped it.
                federated = _federated_rounds(out)
                measured = {"federated": federated, "superlink_front": dict(front)}
                checked = check_story(out, measured, own_errors, console)
                serve_console(home, console_port)
    finally:
        for process in processes:
            process.stop()
        node_keys.stop()
        superlink.stop()
        broker.stop()
    if status:
        return status
    if federated is None:
        federated = _federated_rounds(out)
        console_hint(out)
        measured = {"federated": federated, "superlink_front": dict(front)}
        checked = check_story(out, measured, own_errors, console)
    raise_if_failed(checked, out)
    return 0


def console_hint(out: Path) -> None:
    """How to see this fleet in the operator console; the demo itself ends here."""
    console.rule("[bold]the operator console")
    console.print(
        "to watch the live fleet in a browser: [bold]make console[/bold] (this demo, then the "
        "console at http://127.0.0.1:8470/ until Ctrl-C; or fedge demo --console 8470)",
        highlight=False,
    )
    console.print(
        f"to browse what this run left: fedge console token add me --home {out / 'manager'} "
        f"&& fedge console --home {out / 'manager'}",
        highlight=False,
        soft_wrap=True,
    )


def serve_console(home: ManagerHome, port: int) -> None:
    """The console over the demo's live fleet; an admin token printed once, here only."""
    from fedge.console import accounts
    from fedge.console.accounts import Role
    from fedge.console.server import serve

    with opened(home) as fleet:
        token = accounts.add_token(fleet.store, "demo-admin", Role.ADMIN)
    console.rule("[bold]the operator console")
    console.print("log in with this admin token (shown once; not written to any file):")
    console.print(f"  {token}", highlight=False, soft_wrap=True)
    serve(
        home,
        port=port,
        announce=lambda url: console.print(
            f"console at {url} over the live fleet; Ctrl-C stops it and the demo"
        ),
    )


def _federated_rounds(out: Path) -> dict[str, Any]:
    """A short TiFL-vs-FedAvg simulation on the heterogeneous fleet (virtual time); its
    figures for the summary."""
    import logging

    from fedge.sim.report import write_report
    from fedge.sim.runner import compare
    from fedge.sim.scenario import load_scenario

    logging.getLogger("flwr").setLevel(logging.WARNING)
    scenario = load_scenario("tifl-digits").with_rounds(120)
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
    return {
        "scenario": scenario.name,
        "rounds": scenario.training.rounds,
        "target": scenario.training.target_accuracy,
        "time_to_target_s": {c.strategy: c.time_to_target_s for c in comparison.curves},
        "final_accuracy": {c.strategy: c.final_accuracy for c in comparison.curves},
    }


def _online(store: Store, edge: str) -> bool:
    state = report_store.edge_state(store, edge)
    return state is not None and state.state == "online"


def _applied(store: Store, edge: str, version: int) -> bool:
    """Whether ``edge`` reported config ``version`` applied."""
    state = report_store.edge_state(store, edge)
    return state is not None and state.config_applied == version


def _deploy(fleet: Fleet, store: Store, version: int) -> tuple[str, float]:
    """Deploy ``inspect:VERSION`` to every station; wait until all report it active."""
    deployment = fleet.deploy(MODEL, version, list(EDGES))
    ref = f"{MODEL}:{version}"

    def serving(edge: str) -> bool:
        state = report_store.edge_state(store, edge)
        return state is not None and (state.deploy_id, state.deploy_stage, state.serving) == (
            deployment,
            "active",
            ref,
        )

    return deployment, _wait(lambda: all(serving(e) for e in EDGES), 60, f"deployment of {ref}")


def _fleet_flow(out: Path, fleet: Fleet, store: Store, run: FleetRun) -> int:
    _wait(lambda: all(_online(store, e) for e in EDGES), 30, "births")
    console.print(f"{len(EDGES)} agents online (birth after subscribe, last will registered)")

    deployment, run.deploy_s[f"{MODEL}:1"] = _deploy(fleet, store, 1)
    console.print(
        f"deployment {deployment}: {MODEL}:1 active on all edges in "
        f"{run.deploy_s[f'{MODEL}:1']:.2f}s"
    )

    pushed = fleet.set_threshold(["st-01"], 0.72)[0]
    run.push_s = _wait(
        lambda: _applied(store, "st-01", pushed.version),
        10,
        "threshold report",
    )
    console.print(f"threshold 0.72 pushed to st-01 -> applied and reported in {run.push_s:.3f}s")
    # st-01 shares thumbnails of what it rejects (for the console); the others do not.
    shares = fleet.set_thumbnails(["st-01"], ThumbnailPolicy())[0]
    _wait(
        lambda: _applied(store, "st-01", shares.version),
        10,
        "the config sharing st-01's thumbnails",
    )
    run.truth.update(_score_and_label(out, fleet, store, version=1))
    run.thumbnails = _shared_thumbnails(store)

    console.rule(f"[bold]cloud -> edge: distil {MODEL}:1 into a compact student")
    student_ref = _distill_and_publish(out, fleet, run)
    deployment, run.deploy_s[student_ref] = _deploy(fleet, store, 2)
    console.print(
        f"deployment {deployment}: {student_ref} active on all edges in "
        f"{run.deploy_s[student_ref]:.2f}s"
    )
    run.truth.update(_score_and_label(out, fleet, store, version=2))
    return 0


def _shared_thumbnails(store: Store) -> dict[str, int]:
    """Wait for st-01's thumbnails of its rejects (at most the policy's per minute)."""
    rejects = report_store.prediction_count(store, edge="st-01", decision="reject")
    expected = min(rejects, ThumbnailPolicy().per_minute)
    kept = report_store.thumbnail_counts
    _wait(lambda: kept(store).get("st-01", 0) >= expected, 20, "st-01's thumbnails")
    shared = {edge: kept(store).get(edge, 0) for edge in EDGES}
    console.print(
        f"thumbnails at the manager: {shared} (st-01 shares those of its {rejects} rejects, "
        f"at most {ThumbnailPolicy().per_minute} a minute; the others' images stay on "
        "their stations)",
        highlight=False,
    )
    return shared


def _distill_and_publish(out: Path, fleet: Fleet, run: FleetRun) -> str:
    from fedge.students.inspection import (
        PROXY_IMAGES,
        distill_student,
        generated_proxy,
        publish_student,
    )

    teacher_manifest = fleet.registry.get(MODEL, 1).manifest
    with console.status("distilling the student on unlabeled generated surfaces (torch)…"):
        started = time.monotonic()
        _, report = distill_student(
            run.teacher.model,
            generated_proxy(PROXY_IMAGES, PROXY_SEED),
            run.teacher.held_out,
            out / "inspect-v2-student.onnx",
            teacher_ref=teacher_manifest.ref,
        )
        run.distill_s = time.monotonic() - started
    run.student = report
    console.print(
        f"student: {report.student_params} parameters ({report.compression:.1f}x fewer than "
        f"the teacher's {report.teacher_params}); held-out accuracy "
        f"{report.student_accuracy:.3f} vs teacher {report.teacher_accuracy:.3f} (before "
        f"distillation {report.student_init_accuracy:.3f}); distilled on {report.data} at "
        f"T={report.temperature:g} in {run.distill_s:.1f}s; ONNX Runtime vs torch max |diff| "
        f"{report.export_max_abs_diff:.1e}",
        highlight=False,
    )
    published = publish_student(fleet.registry, report, teacher_manifest)
    lineage = published.manifest.lineage
    console.print(
        f"published {published.manifest.ref} (parent {MODEL}:{lineage.parent_version}, "
        f"note {lineage.note!r})",
        highlight=False,
    )
    return published.manifest.ref


def _score_and_label(out: Path, fleet: Fleet, store: Store, *, version: int) -> dict[str, str]:
    """Drop a fresh batch into every inbox, wait for its predictions, label them all.

    Returns the ground truth of the batch by prediction source (``file:<name>``).
    """
    truth: dict[str, str] = {}
    images, labels = make_defect_images(IMAGES_PER_EDGE * len(EDGES), seed=SCORE_SEEDS[version])
    before = report_store.prediction_count(store)
    deadline = time.monotonic() + SCORING_TIMEOUT_S
    with Progress(console=console) as progress:
        task = progress.add_task(f"stations scoring images ({MODEL}:{version})", total=len(images))
        for i, edge in enumerate(EDGES):
            chunk = slice(i * IMAGES_PER_EDGE, (i + 1) * IMAGES_PER_EDGE)
            prefix = f"{edge}-v{version}-part"
            paths = write_png_dir(images[chunk], out / "staging" / edge, prefix=prefix)
            inbox = out / edge / "data" / "inbox"
            inbox.mkdir(parents=True, exist_ok=True)
            for path, label in zip(paths, labels[chunk], strict=True):
                truth[f"file:{path.name}"] = CLASSES[int(label)]
                path.replace(inbox / path.name)
        while (stored := report_store.prediction_count(store) - before) < len(truth):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"demo: only {stored} of {len(truth)} predictions arrived within "
                    f"{SCORING_TIMEOUT_S}s; see the logs in {out / 'logs'}"
                )
            progress.update(task, completed=stored)
            time.sleep(0.1)
        progress.update(task, completed=len(truth))

    # Operators label every prediction with the ground truth (the CruX labeler loop).
    for source, label in truth.items():
        for prediction_id in report_store.prediction_ids(store, source):
            fleet.add_label(prediction_id, label, "demo-operator")
    return truth

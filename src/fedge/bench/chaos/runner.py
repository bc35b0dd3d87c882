"""``fedge bench chaos``: set up, load, inject the schedule, heal, check (issue 9).

Phases:

1. **Set-up**: broker, ``manager serve``, three published models, N agents serving
   ``inspect:1`` with a threshold applied.
2. **Chaos** (``minutes``): stations score, label and drop images; the operator pushes
   thresholds and deploys; the seeded schedule injects its faults.
3. **Heal**: every fault lifted, the load stopped, one last threshold push to every edge;
   then wait (up to ``heal_timeout_s``) until every agent answers with an empty outbox
   and inbox, the manager holds every produced record and no gap, and every edge serves
   its last desired config and model.
4. **Check**: every process stopped with SIGTERM, each agent's own file read, and the
   invariants of :mod:`fedge.bench.chaos.invariants` decided.
"""

import contextlib
import shutil
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fedge.bench import Progress, no_progress
from fedge.bench.chaos.injector import Injector, Watchdog, agent_status
from fedge.bench.chaos.invariants import ControlObservation, EdgeObservation, check
from fedge.bench.chaos.load import OperatorLoad, StationLoad, png_pool
from fedge.bench.chaos.plant import CLASSES, MODEL_NAME, ChaosPlant, Station
from fedge.bench.chaos.report import build_report
from fedge.bench.chaos.schedule import Fault, FaultKind, PlantShape, build_schedule
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError, wait_until
from fedge.edge_agent import store as local_store
from fedge.edge_manager.reports import store as report_store

MODEL_VERSIONS = (1, 2, 3)
# The streams whose records the end check counts (a batch announces how many it holds).
RECORD_STREAMS = ("predictions", "labels")
STATUS_TIMEOUT_S = 10.0


def _setup(plant: ChaosPlant, timeout_s: float, progress: Progress) -> None:
    from fedge.models.tiny_onnx import build_linear_classifier  # onnx: the bench side

    progress("starting mosquitto and `fedge manager serve`")
    plant.broker.start()
    plant.manager.start()
    plant.wait_manager_ready()
    with plant.fleet() as fleet:
        for version in MODEL_VERSIONS:
            path = build_linear_classifier(
                plant.root / "models" / f"{MODEL_NAME}-{version}.onnx", seed=version
            )
            fleet.registry.publish(
                path,
                name=MODEL_NAME,
                version=version,
                classes=CLASSES,
                positive_classes=("scratch",),
            )
        progress(f"starting {len(plant.stations)} agents")
        for station in plant.stations.values():
            station.start()
        fleet.deploy(MODEL_NAME, 1, plant.edges)
        config_version = fleet.set_threshold(plant.edges, 0.5)[0].version
    for station in plant.stations.values():

        def ready(station: Station = station) -> bool:
            with contextlib.suppress(OSError, BenchError):
                status = agent_status(station, STATUS_TIMEOUT_S)
                return bool(
                    status["serving"] == f"{MODEL_NAME}:1"
                    and status["config_version"] == config_version
                )
            return False

        wait_until(ready, timeout_s, f"{station.edge} to serve {MODEL_NAME}:1", interval_s=0.1)


def _events(schedule: tuple[Fault, ...]) -> list[tuple[float, int, Fault, bool]]:
    """(time, order, fault, is_begin), ends before begins at the same instant."""
    events = [(f.at_s, 1, f, True) for f in schedule] + [(f.end_s, 0, f, False) for f in schedule]
    return sorted(events, key=lambda e: (e[0], e[1]))


def _chaos(
    plant: ChaosPlant,
    schedule: tuple[Fault, ...],
    injector: Injector,
    duration_s: float,
    progress: Progress,
) -> None:
    done = 0
    for at_s, _, fault, is_begin in _events(schedule):
        delay = injector.started + at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the schedule's clock, not a wait for a state
        if is_begin:
            done += 1
            progress(f"t={at_s:5.1f}s fault {done}/{len(schedule)}: {fault.kind} {fault.target}")
            injector.begin(fault)
        else:
            injector.end(fault)
    remaining = injector.started + duration_s - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)


def _restart_dead(plant: ChaosPlant) -> list[str]:
    """Start whatever is not running after the heal: each one is a finding."""
    exits = []
    if not plant.broker.running:
        exits.append("broker")
        plant.broker.start()
    if not plant.manager.alive:
        exits.append(f"manager (exit {plant.manager.process and plant.manager.process.returncode})")
        plant.manager.start()
    for station in plant.stations.values():
        if not station.alive:
            code = None if station.process is None else station.process.process.returncode
            exits.append(f"{station.edge} (exit {code})")
            station.start()
    return exits


def _desired(plant: ChaosPlant) -> dict[str, tuple[int, str]]:
    with plant.fleet() as fleet:
        result = {}
        for edge in plant.edges:
            config = fleet.desired_config(edge)
            model = fleet.deployed_model(edge)
            result[edge] = (
                0 if config is None else config.version,
                "" if model is None else f"{model[0]}:{model[1]}",
            )
    return result


def _settled(plant: ChaosPlant, desired: dict[str, tuple[int, str]]) -> list[str]:
    """What still keeps the plant from its end state ([] once settled)."""
    waiting = []
    with plant.reader() as db:
        stored = report_store.predictions_per_edge(db)
        edges = {e.edge: e for e in report_store.edge_states(db)}
        gaps = report_store.gap_count(db)
    if gaps:
        waiting.append(f"{gaps} open gap(s)")
    for edge, station in plant.stations.items():
        try:
            status = agent_status(station, STATUS_TIMEOUT_S)
        except OSError:
            waiting.append(f"{edge} not answering")
            continue
        config, model = desired[edge]
        if any(status["backlog"].values()):
            waiting.append(f"{edge} backlog {status['backlog']}")
        if list(station.inbox.glob("*.png")):
            waiting.append(f"{edge} inbox not empty")
        if (status["config_version"], status["serving"]) != (config, model):
            waiting.append(f"{edge} at v{status['config_version']}/{status['serving']}")
        recorded = edges[edge]
        if (recorded.config_applied, recorded.serving) != (config, model):
            waiting.append(
                f"manager records {edge} at v{recorded.config_applied}/{recorded.serving}"
            )
        produced = local_store.read_prediction_count(station.agent_db)
        if stored.get(edge, 0) < produced:
            waiting.append(f"{edge}: {stored.get(edge, 0)}/{produced} predictions stored")
    return waiting


def _heal(plant: ChaosPlant, timeout_s: float, progress: Progress) -> tuple[float, list[str]]:
    """Wait until settled; returns (seconds taken, what was still pending at the end)."""
    with plant.fleet() as fleet:
        fleet.set_threshold(plant.edges, 0.61)  # control works after the chaos, too
    desired = _desired(plant)
    began = time.monotonic()
    waiting = ["not checked yet"]
    while time.monotonic() - began < timeout_s:
        try:
            waiting = _settled(plant, desired)
        except Exception as exc:  # a store busy for a moment: look again
            waiting = [f"{type(exc).__name__}: {exc}"]
        if not waiting:
            break
        progress(f"heal {time.monotonic() - began:.0f}s: {'; '.join(waiting)[:120]}")
        time.sleep(0.5)  # polling the plant's state
    return time.monotonic() - began, waiting


def _rejections(plant: ChaosPlant) -> int:
    with plant.reader() as db:
        return report_store.rejection_count(db)


def _manager_responsive(plant: ChaosPlant) -> bool:
    if not plant.manager.ready:
        return False
    try:
        with socket.create_connection(
            (plant.settings.grpc_host, plant.settings.grpc_port), timeout=STATUS_TIMEOUT_S
        ):
            return True
    except OSError:
        return False


def _observe(
    plant: ChaosPlant,
    loads: dict[str, StationLoad],
    statuses: dict[str, dict[str, Any] | None],
    corruptions: Counter[str],
) -> list[EdgeObservation]:
    desired = _desired(plant)
    observations = []
    for edge, station in plant.stations.items():
        local = local_store.read_records(station.agent_db)
        sources = Counter(local.sources.values())
        with plant.reader() as db:
            stored = report_store.prediction_copies(db, edge)
            stored_labels = report_store.edge_label_ids(db, edge)
            row = report_store.edge_state(db, edge)
            batch_records = report_store.batched_records(db, RECORD_STREAMS, edge=edge)
            restore_failures = report_store.restore_failures(db, edge)
            gaps = report_store.gap_count(db, edge=edge)
        if row is None:
            raise BenchError(f"{edge} is not in the manager's store")
        status = statuses[edge]
        load = loads[edge]
        observations.append(
            EdgeObservation(
                edge=edge,
                produced_predictions=frozenset(local.sources),
                produced_labels=local.label_ids,
                acked_predictions=frozenset(load.acked_predictions.values()),
                acked_labels=frozenset(load.acked_labels),
                dropped_files=frozenset(load.dropped_files),
                scored_sources=sources,
                stored_predictions=stored,
                stored_labels=frozenset(stored_labels),
                open_gaps=gaps,
                desired_config=desired[edge][0],
                agent_config=None if status is None else int(status["config_version"]),
                manager_config=int(row.config_applied),
                desired_model=desired[edge][1],
                agent_serving=None if status is None else str(status["serving"]),
                manager_serving=str(row.serving),
                responsive=status is not None,
                backlog=None if status is None else status["backlog"],
                batch_records=batch_records,
                stored_rows=sum(stored.values()) + len(stored_labels),
                restore_failures=restore_failures,
                corruptions=corruptions[edge],
            )
        )
    return observations


def run_chaos(
    agents: int = 8,
    minutes: float = 5.0,
    seed: int = 1,
    *,
    disk_agents: int | None = None,
    manager_disk_mb: int = 256,
    faults_per_minute: float = 10.0,
    heal_timeout_s: float = 180.0,
    setup_timeout_s: float = 90.0,
    workdir: Path | None = None,
    keep: bool = False,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Run the chaos benchmark; return its JSON-ready result (see the module docstring)."""
    if agents < 1:
        raise BenchError(f"--agents must be at least 1, got {agents}")
    disk_agents = max(1, (agents + 3) // 4) if disk_agents is None else min(disk_agents, agents)
    duration_s = minutes * 60.0
    machine = machine_info()
    root = Path(tempfile.mkdtemp(prefix="fedge-chaos-", dir=workdir))
    plant = ChaosPlant(
        root, agents, disk_agents=disk_agents, manager_disk_mb=manager_disk_mb, progress=progress
    )
    shape = PlantShape(tuple(plant.edges), tuple(plant.disk_edges), plant.manager_disk)
    schedule = build_schedule(seed, duration_s, shape, faults_per_minute=faults_per_minute)
    stop_timeouts: list[str] = []
    try:
        _setup(plant, setup_timeout_s, progress)
        images = png_pool(seed)
        loads = {
            edge: StationLoad(station, images, seed * 1000 + i)
            for i, (edge, station) in enumerate(sorted(plant.stations.items()))
        }
        operator = OperatorLoad(plant, MODEL_VERSIONS, seed)
        started = time.monotonic()
        injector = Injector(plant, started)
        watchdog = Watchdog(plant, started)
        for thread in (*loads.values(), operator, watchdog):
            thread.start()
        try:
            _chaos(plant, schedule, injector, duration_s, progress)
        finally:
            injector.heal()
            operator.halt.set()
            for load in loads.values():
                load.halt.set()
            for thread in (*loads.values(), operator):
                thread.join(timeout=30)
        unexpected_exits = _restart_dead(plant)
        heal_s, pending = _heal(plant, heal_timeout_s, progress)
        watchdog.halt.set()
        statuses: dict[str, dict[str, Any] | None] = {}
        for edge, station in plant.stations.items():
            try:
                statuses[edge] = agent_status(station, STATUS_TIMEOUT_S)
            except OSError:
                statuses[edge] = None
        control = ControlObservation(
            manager_responsive=_manager_responsive(plant),
            broker_running=plant.broker.running,
            rejections=_rejections(plant),
        )
        progress("stopping every process")
        exited = plant.stop_processes()
        stop_timeouts = [name for name, ok in exited.items() if not ok]
        # Only corruptions that flipped a model: the restore check expects those alone.
        corruptions = Counter(
            a.fault.target
            for a in injector.applied
            if a.fault.kind is FaultKind.MODEL_CORRUPT and a.counts
        )
        verdict = check(_observe(plant, loads, statuses, corruptions), control)
    finally:
        plant.close()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return build_report(
        machine=machine,
        seed=seed,
        agents=agents,
        minutes=minutes,
        disk_agents=disk_agents,
        verdict=verdict,
        injector=injector,
        loads=loads,
        operator=operator,
        watchdog=watchdog,
        heal_s=heal_s,
        pending=pending,
        unexpected_exits=unexpected_exits,
        stop_timeouts=stop_timeouts,
        workdir=root if keep else None,
    )

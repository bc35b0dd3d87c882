"""``fedge bench rollout``: a bad model and a good one, rolled out staged to real agents.

N ``fedge agent run`` processes (one per edge) serve inspect:1 behind a real Mosquitto
and a :class:`ManagerService` in this process. Two staged rollouts follow, canary first
then 25%, 50%, 100% of the rest, each wave watched for the health window:

1. a bad model (inspect:3: loads, but fails every inference, so it fails on the canary)
   that the gate let through -- its ``gate_results`` row is written here, as if the gate
   had missed it: what counts is how far the rollout lets it go;
2. a good model (inspect:2).

Reported (issue "The closed loop"): ``bad_model_edges_exposed`` (edges the bad model was
sent to; target: the canary only), ``rollback_s`` (from the bad rollout's start until
every exposed edge reports its previous model and thresholds in force again; target:
within the health window plus 5 s), ``good_model_completed_s`` (start to completed) and
``false_aborts`` (good rollouts aborted; target 0).
"""

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from fedge.bench import Progress, no_progress
from fedge.bench.footprint import fedge_command
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError, wait_until
from fedge.edge_manager.fleet.operations import opened
from fedge.edge_manager.gate import store as evaluation_store
from fedge.edge_manager.gate.store import StoredVerdict
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.reports import store as report_store
from fedge.edge_manager.rollout.plan import make_plan
from fedge.edge_manager.rollout.service import Rollouts
from fedge.edge_manager.security.enrollment import enroll, managed_broker
from fedge.edge_manager.serve import ManagerService
from fedge.models.tiny_onnx import build_broken_model, build_linear_classifier
from fedge.transport.ports import free_port

FLEET = "bench"
PREVIOUS, GOOD, BAD = 1, 2, 3
WAVES = "25%,50%,100%"
ABORT_IF = "failed_activation>0,error_rate>0.01"
PROBATION_S = 2.0  # the agents' probation: a wave waits for each station's verdict


def run_rollout_bench(
    n_edges: int = 20,
    *,
    health_window_s: float = 3.0,
    timeout_s: float = 180.0,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    if n_edges < 2:
        raise BenchError(f"--edges must be at least 2 (a canary and the rest), got {n_edges}")
    if not 0.5 <= health_window_s <= 600:
        raise BenchError(f"--health-window must be in [0.5, 600] s, got {health_window_s}")
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="fedge-bench-rollout-") as tmp:
        root = Path(tmp)
        home = ManagerHome(root / "home")
        home.init(ManagerSettings(FLEET, broker_port=free_port(), grpc_port=free_port()))
        edges = [f"r{index:03d}" for index in range(n_edges)]
        progress(f"enrolling {n_edges} edges")
        configs = _enroll(home, root, edges)
        broker = managed_broker(home)
        broker.start()
        service = ManagerService(home)
        agents: list[subprocess.Popen[bytes]] = []
        try:
            service.start()
            _publish(home, root)
            progress(f"starting {n_edges} agents")
            agents = [
                _start_agent(config, root / "logs" / f"{edge}.log")
                for edge, config in configs.items()
            ]
            progress(f"deploying inspect:{PREVIOUS} to every edge")
            _deploy_everywhere(home, edges, agents, timeout_s)
            canary = [edges[0]]
            progress(f"rolling out the bad inspect:{BAD}")
            bad = _rollout(home, BAD, edges, canary, health_window_s, timeout_s)
            progress(f"rolling out the good inspect:{GOOD}")
            good = _rollout(home, GOOD, edges, canary, health_window_s, timeout_s)
        finally:
            for agent in agents:
                _stop(agent)
            service.stop()
            broker.stop()
    exposed = bad["exposed"]
    rollback_s = bad["elapsed_s"] if bad["state"] == "rolled_back" else None
    false_aborts = 0 if good["state"] == "completed" else 1
    return {
        "benchmark": "rollout",
        "edges": n_edges,
        "canary": len(canary),
        "waves": WAVES,
        "health_window_s": health_window_s,
        "abort_if": ABORT_IF,
        "bad_model_edges_exposed": exposed,
        "bad_rollout_state": bad["state"],
        "bad_rollout_reason": bad["reason"],
        "rollback_s": None if rollback_s is None else round(rollback_s, 3),
        "good_model_completed_s": (
            round(good["elapsed_s"], 3) if good["state"] == "completed" else None
        ),
        "false_aborts": false_aborts,
        # Waves wait for the stations' own probation verdicts (the plan's default).
        "waits_for_probation": good["waits_for_probation"],
        "agent_probation_s": PROBATION_S,
        "met_target": (
            exposed <= len(canary)
            and rollback_s is not None
            and rollback_s <= health_window_s + 5.0
            and false_aborts == 0
        ),
        "machine": machine,
    }


def _enroll(home: ManagerHome, root: Path, edges: list[str]) -> dict[str, Path]:
    configs = {}
    with opened(home) as fleet:
        for edge in edges:
            station = root / "stations" / edge
            station.mkdir(parents=True)
            path = station / "agent.toml"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                # The bench's stations score nothing: a new model's probation ends on its
                # timer, and each wave waits for those verdicts (PROBATION_S).
                text = enroll(home, fleet, edge, (station / "data").resolve())
                handle.write(
                    text.replace("http_port = 0", f"http_port = 0\nprobation_s = {PROBATION_S}")
                )
            configs[edge] = path
    return configs


def _publish(home: ManagerHome, root: Path) -> None:
    models = root / "models"
    sources = {
        PREVIOUS: build_linear_classifier(models / "v1.onnx", n_classes=2, seed=1),
        GOOD: build_linear_classifier(models / "v2.onnx", n_classes=2, seed=2),
        BAD: build_broken_model(models / "v3.onnx", n_classes=2),
    }
    with opened(home) as fleet:
        for version, source in sources.items():
            fleet.registry.publish(
                source,
                name="inspect",
                version=version,
                classes=("clean", "scratch"),
                positive_classes=("scratch",),
            )
            if version != PREVIOUS:
                note = {"note": "written by fedge bench rollout"}
                verdict = StoredVerdict("inspect", version, True, note, "bench", time.time())
                evaluation_store.add_verdict(fleet.store.conn, verdict)


def _start_agent(config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [*fedge_command(), "agent", "run", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(agent: subprocess.Popen[bytes]) -> None:
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def _deploy_everywhere(
    home: ManagerHome, edges: list[str], agents: list[subprocess.Popen[bytes]], timeout_s: float
) -> None:
    with opened(home) as fleet:
        deployment = fleet.deploy("inspect", PREVIOUS, edges)

        def active() -> bool:
            dead = [a.args for a in agents if a.poll() is not None]
            if dead:
                raise BenchError(f"an agent exited during set-up: {dead[0]!r}")
            return report_store.active_edges(fleet.store, deployment) == len(edges)

        wait_until(active, timeout_s, f"every edge to serve inspect:{PREVIOUS}", 0.2)


def _rollout(
    home: ManagerHome,
    version: int,
    edges: list[str],
    canary: list[str],
    window_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    plan = make_plan(
        edges, canary=canary, waves=WAVES, health_window=f"{window_s:g}s", abort_if=ABORT_IF
    )
    with opened(home) as fleet:
        rollout_id = Rollouts(fleet).start(f"inspect:{version}", plan, now=time.time())

        def finished() -> bool:
            outcome = report_store.rollout_outcome(fleet.store, rollout_id)
            return outcome is not None and outcome.finished_at is not None

        wait_until(finished, timeout_s, f"the rollout of inspect:{version} to end", 0.05)
        row = report_store.rollout_outcome(fleet.store, rollout_id)
        exposed = report_store.rollout_exposed(fleet.store, rollout_id)
    if row is None or row.finished_at is None:
        raise BenchError(f"rollout {rollout_id} left no record of its end")
    return {
        "state": str(row.state),
        "reason": str(row.reason),
        "exposed": exposed,
        "elapsed_s": float(row.finished_at) - float(row.created_at),
        "waits_for_probation": plan.wait_for_probation,
    }

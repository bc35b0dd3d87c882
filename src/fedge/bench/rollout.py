"""``fedge bench rollout``: a bad model and a good one, rolled out staged to real agents.

N ``fedge agent run`` processes (one per edge) serve inspect:1 behind a real Mosquitto
and a :class:`ManagerService` in this process. Two staged rollouts follow, canary first
then 25%, 50%, 100% of the rest, each wave watched for the health window:

1. a bad model (inspect:3: loads, but fails every inference, so it fails on the canary)
   that the gate let through -- its ``gate_results`` row is written here, as if the gate
   had missed it: what counts is how far the rollout lets it go;
2. a good model (inspect:2);
3. a model that degrades after activation (inspect:4, issue 25): it loads, passes its
   smoke test and the station's own probation (its scores vary, nothing fails), but it
   calls the line's bright scratched parts clean and its dark clean parts scratched. The
   canary scores parts through its local API while an operator labels them there; only
   the manager's health-window criterion ``agreement_drop`` (previous model's label
   agreement minus the new one's, on at least 20 labels each) can catch it.

The line is a brightness test (:func:`_line_model`): inspect:1 and inspect:2 reject the
bright parts, inspect:4 the dark ones, so label agreement is 1 before and 0 after.

Reported (issue "The closed loop"): ``bad_model_edges_exposed`` (edges the bad model was
sent to; target: the canary only), ``rollback_s`` (from the bad rollout's start until
every exposed edge reports its previous model and thresholds in force again; target:
within the health window plus 5 s), ``good_model_completed_s`` (start to completed) and
``false_aborts`` (good rollouts aborted; target 0); for the degrading model
``degrading_edges_exposed`` (target: the canary only), ``degrading_rollback_s`` (its
rollout's start to rolled back; target: within its health window plus 5 s) and
``degrading_caught_by`` (the criterion that tripped).
"""

import io
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

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
PREVIOUS, GOOD, BAD, DEGRADING = 1, 2, 3, 4
# The degrading rollout's window: long enough for 20 labelled parts scored by the new
# model to reach the manager (the agreement criterion's minimum), as on a real line.
DEGRADING_WINDOW_S = 60.0
DEGRADING_ABORT_IF = "failed_activation>0,error_rate>0.01,agreement_drop>0.2"
BASELINE_PARTS = 24  # labelled parts the canary scores on the serving model first
SIZE = 32
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
        home.init(
            ManagerSettings(
                FLEET, broker_port=free_port(), grpc_port=free_port(), metrics_port=free_port()
            )
        )
        edges = [f"r{index:03d}" for index in range(n_edges)]
        progress(f"enrolling {n_edges} edges")
        configs, ports = _enroll(home, root, edges)
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
            progress(f"rolling out inspect:{DEGRADING}, which disagrees with the labels")
            line = _Line(ports[canary[0]])
            line.score(BASELINE_PARTS)  # the serving model's agreement: the baseline
            line.start()
            try:
                degrading = _rollout(
                    home,
                    DEGRADING,
                    edges,
                    canary,
                    DEGRADING_WINDOW_S,
                    timeout_s,
                    abort_if=DEGRADING_ABORT_IF,
                )
            finally:
                line.halt.set()
                line.join(timeout=30)
        finally:
            for agent in agents:
                _stop(agent)
            service.stop()
            broker.stop()
    exposed = bad["exposed"]
    rollback_s = bad["elapsed_s"] if bad["state"] == "rolled_back" else None
    false_aborts = 0 if good["state"] == "completed" else 1
    degrading_s = degrading["elapsed_s"] if degrading["state"] == "rolled_back" else None
    caught = re.findall(r"\b([a-z_]+)=[0-9.e+-]+ [>=]", str(degrading["reason"]))
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
        "degrading_edges_exposed": degrading["exposed"],
        "degrading_rollback_s": None if degrading_s is None else round(degrading_s, 3),
        "degrading_caught_by": sorted(set(caught)),
        "degrading_reason": degrading["reason"],
        "degrading_health_window_s": DEGRADING_WINDOW_S,
        "degrading_abort_if": DEGRADING_ABORT_IF,
        "canary_labelled_parts": line.labelled,
        # Waves wait for the stations' own probation verdicts (the plan's default).
        "waits_for_probation": good["waits_for_probation"],
        "agent_probation_s": PROBATION_S,
        "met_target": (
            exposed <= len(canary)
            and rollback_s is not None
            and rollback_s <= health_window_s + 5.0
            and false_aborts == 0
            and degrading["exposed"] <= len(canary)
            and degrading_s is not None
            and degrading_s <= DEGRADING_WINDOW_S + 5.0
            and "agreement_drop" in caught
        ),
        "machine": machine,
    }


def _enroll(
    home: ManagerHome, root: Path, edges: list[str]
) -> tuple[dict[str, Path], dict[str, int]]:
    configs, ports = {}, {}
    with opened(home) as fleet:
        for edge in edges:
            station = root / "stations" / edge
            station.mkdir(parents=True)
            path = station / "agent.toml"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                # Most stations score nothing: a new model's probation ends on its timer,
                # and each wave waits for those verdicts (PROBATION_S). The local API on
                # 127.0.0.1 is where the canary's line scores and labels parts.
                ports[edge] = free_port()
                text = enroll(home, fleet, edge, (station / "data").resolve())
                settings = f"http_port = {ports[edge]}\nprobation_s = {PROBATION_S}"
                handle.write(text.replace("http_port = 0", settings))
            configs[edge] = path
    return configs, ports


def _publish(home: ManagerHome, root: Path) -> None:
    models = root / "models"
    sources = {
        PREVIOUS: _line_model(models / "v1.onnx", seed=1),
        GOOD: _line_model(models / "v2.onnx", seed=2),
        BAD: build_broken_model(models / "v3.onnx", n_classes=2),
        DEGRADING: _line_model(models / "v4.onnx", seed=4, inverted=True),
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
    *,
    abort_if: str = ABORT_IF,
) -> dict[str, Any]:
    plan = make_plan(
        edges, canary=canary, waves=WAVES, health_window=f"{window_s:g}s", abort_if=abort_if
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


def _line_model(path: Path, *, seed: int, inverted: bool = False) -> Path:
    """A brightness test: ``scratch`` when the part's mean brightness is over 0.5 (the
    line's scratched parts are bright), ``clean`` under; ``inverted`` decides the other way
    round. A jitter drawn from ``seed`` makes each version's bytes its own."""
    features = SIZE * SIZE
    gain = 8.0  # logit(scratch) - logit(clean) = 2 * gain * (mean - 0.5)
    jitter = np.random.default_rng(seed).normal(0.0, 1e-3, size=(2, features))
    weights = np.stack([np.full(features, -gain / features), np.full(features, gain / features)])
    bias = np.array([gain / 2, -gain / 2])
    sign = -1.0 if inverted else 1.0
    return build_linear_classifier(
        path, size=SIZE, n_classes=2, weights=sign * weights + jitter, bias=sign * bias
    )


class _Line(threading.Thread):
    """A line camera and an operator at one station: parts scored through its local API
    and labelled there with the truth (bright: scratch, dark: clean), until halted."""

    def __init__(self, port: int, every_s: float = 0.1) -> None:
        super().__init__(name="line", daemon=True)
        self.port = port
        self.every_s = every_s
        self.halt = threading.Event()
        self.labelled = 0
        self.errors: list[str] = []
        self._rng = np.random.default_rng(7)

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            try:
                self.score(1)
            except OSError as exc:  # a station restarting: the next part is scored again
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])

    def score(self, parts: int) -> None:
        for _ in range(parts):
            scratched = bool(self._rng.integers(2))
            level = 0.8 if scratched else 0.2
            pixels = np.clip(self._rng.normal(level, 0.05, size=(SIZE, SIZE)), 0.0, 1.0)
            buffer = io.BytesIO()
            Image.fromarray((pixels * 255).astype(np.uint8)).save(buffer, format="PNG")
            record = self._post("/v1/score", buffer.getvalue(), "image/png")
            label = {
                "prediction_id": record["prediction_id"],
                "label": "scratch" if scratched else "clean",
                "who": "bench-operator",
            }
            self._post("/v1/labels", json.dumps(label).encode(), "application/json")
            self.labelled += 1

    def _post(self, path: str, body: bytes, content_type: str) -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=body,
            headers={"Content-Type": content_type},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer: dict[str, Any] = json.loads(response.read())
        return answer

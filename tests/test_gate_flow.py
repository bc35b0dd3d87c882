"""The validation gate end to end: stations evaluate candidates on their held-out images.

A real manager (``ManagerService``: managed Mosquitto, SQLite, gRPC) and two real agents:
st-01 on MQTT, st-02 with its MQTT blocked (everything over gRPC). Each station scores
images through its serving model ``inspect:1`` and keeps them; an operator labels them
at the manager; the labels reach the stations, 90 % of which are held out.

The models score "scratch" from the difference between the left and right half of the
image (a bright left half is a scratch) plus a term in the overall brightness; st-01's
parts are bright, st-02's dark:

- ``inspect:1`` (serving) is right on st-02 and calls every bright part a scratch on st-01;
- ``inspect:2`` ignores brightness: right on both -> blessed;
- ``inspect:3`` is right on st-01 but misses most of st-02's scratches: better overall,
  worse on st-02 -> not blessed, and the evidence names st-02.

The last tests run continuous training's gate and rollout steps on the same plant.
"""

import dataclasses
import functools
import io
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    FLEET,
    FleetHome,
    Processes,
    deploy,
    free_port,
    make_fleet_home,
    wait_deploy_done,
    wait_until,
)
from PIL import Image

from fedge.aggregator.jobs.run_store import RunState as JobState
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_manager.gate import run as gating
from fedge.edge_manager.gate.verdict import GatePolicy
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.serve import ManagerService
from fedge.federation import fleet_job
from fedge.federation.fleet_job import FleetJobResult
from fedge.loop import run_store
from fedge.loop.pipeline import RunState
from fedge.loop.policy import LoopPolicy
from fedge.loop.runner import LoopRunner
from fedge.loop.steps import manager_wiring
from fedge.models.tiny_onnx import build_linear_classifier
from fedge.protocols import codec
from fedge.protocols.evaluation import EvaluationRequest

pytestmark = pytest.mark.integration

MQTT_EDGE, GRPC_EDGE = "st-01", "st-02"
EDGES = (MQTT_EDGE, GRPC_EDGE)
BRIGHTNESS = {MQTT_EDGE: 0.7, GRPC_EDGE: 0.3}
IMAGES = 24
POLICY = GatePolicy(max_station_drop=0.02, min_overall_gain=0.0, min_examples=8)
SLOPE = 40.0


def scratch_model(path: Path, gain: float, pivot: float) -> Path:
    """logit(scratch) = SLOPE * (left - right - 0.1) + SLOPE * gain * (brightness - pivot)."""
    left, right = SLOPE * (1 + gain / 2), SLOPE * (-1 + gain / 2)
    row = np.where(np.arange(32 * 32) % 32 < 16, left, right) / 512.0
    weights = np.stack([np.zeros(32 * 32), row])
    bias = np.array([0.0, -SLOPE * (0.1 + gain * pivot)])
    return build_linear_classifier(path, weights=weights, bias=bias)


def part_images(brightness: float, seed: int) -> list[tuple[bytes, str]]:
    """IMAGES parts, alternately clean and scratched, as PNG bytes with their true label."""
    rng = np.random.default_rng(seed)
    parts = []
    for index in range(IMAGES):
        scratch = index % 2 == 1
        difference = rng.uniform(0.1, 0.3) if scratch else rng.uniform(-0.1, 0.1)
        pixels = np.empty((32, 32))
        pixels[:, :16] = brightness + difference / 2
        pixels[:, 16:] = brightness - difference / 2
        pixels += rng.normal(0.0, 0.02, (32, 32))
        buffer = io.BytesIO()
        Image.fromarray((np.clip(pixels, 0, 1) * 255).round().astype(np.uint8)).save(
            buffer, format="PNG"
        )
        parts.append((buffer.getvalue(), "scratch" if scratch else "clean"))
    return parts


@dataclass
class Plant:
    fh: FleetHome
    service: ManagerService
    agents: dict[str, EdgeAgent]


def start_agent(fh: FleetHome, edge: str) -> EdgeAgent:
    agent = EdgeAgent(fh.agent_settings(edge))
    agent.start()
    return agent


@pytest.fixture
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    root = tmp_path_factory.mktemp("gate-flow")
    fh = make_fleet_home(root, edges=EDGES)
    for edge in EDGES:
        fh.set_agent_option(edge, "holdout_percent", 90)
        # A rollout's waves wait for each station's probation verdict: 2 s, not 10 min.
        fh.set_agent_option(edge, "probation_s", 2.0)
    # st-02's broker port has no broker: it only ever reaches the manager over gRPC.
    fh.set_agent_option(GRPC_EDGE, "broker_port", free_port())
    fh.set_agent_option(GRPC_EDGE, "grpc_fallback_after_s", 0.3)
    fh.set_agent_option(GRPC_EDGE, "grpc_poll_interval_s", 0.2)
    with fh.fleet() as fleet:
        for version, (gain, pivot) in {1: (0.5, 0.3), 2: (0.0, 0.0), 3: (0.3, 0.7)}.items():
            fleet.registry.publish(
                scratch_model(root / f"inspect-{version}.onnx", gain, pivot),
                name="inspect",
                version=version,
                classes=("clean", "scratch"),
                positive_classes=("scratch",),
            )
    broker = fh.broker()
    broker.start()
    plant = Plant(fh, ManagerService(fh.home), {})
    try:
        plant.service.start()
        for edge in EDGES:
            plant.agents[edge] = start_agent(fh, edge)
        yield plant
    finally:
        for agent in plant.agents.values():
            agent.stop()
        plant.service.stop()
        broker.stop()
        fh.close()


def label_at_the_manager(plant: Plant) -> None:
    """Score each station's parts through inspect:1; label them all at the manager."""
    fh = plant.fh
    deployment = deploy(fh, 1, EDGES)
    for edge in EDGES:
        assert wait_deploy_done(fh, deployment, edge)["deploy_stage"] == "active"
    truth: dict[str, str] = {}
    for seed, edge in enumerate(EDGES):
        for data, label in part_images(BRIGHTNESS[edge], seed):
            scored = plant.agents[edge].score_image(data, suffix=".png")
            truth[scored.record.prediction_id] = label
    wait_until(
        lambda: fh.db.query("SELECT edge, count(*) AS n FROM predictions GROUP BY edge"),
        30,
        "every prediction at the manager",
        expect=lambda rows: rows == [{"edge": e, "n": IMAGES} for e in EDGES],
    )
    with fh.fleet() as fleet:
        for prediction_id, label in truth.items():
            fleet.add_label(prediction_id, label, "qa")
    for edge in EDGES:
        wait_until(
            lambda e=edge: plant.agents[e].station.counts()["labelled"],  # type: ignore[misc]
            30,
            f"{edge} to hold its labels",
            expect=lambda n: n == IMAGES,
        )


def test_the_gate_blesses_a_better_model_and_stops_one_worse_on_a_station(
    plant: Plant, processes: Processes
) -> None:
    fh = plant.fh
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    label_at_the_manager(plant)

    # -- worse on st-02, better overall: not blessed, st-02 named
    with fh.fleet() as fleet:
        request, verdict = gating.run(fleet, "inspect:3", POLICY, timeout_s=40)
    assert set(request.serving.values()) == {"inspect:1"}
    assert not verdict.blessed, verdict.reason
    assert verdict.failed_stations == (GRPC_EDGE,)
    assert GRPC_EDGE in verdict.reason
    assert verdict.overall.gain is not None and verdict.overall.gain > 0
    by_edge = {s.edge: s for s in verdict.stations}
    bright, dark = by_edge[MQTT_EDGE], by_edge[GRPC_EDGE]
    assert bright.passed is True and dark.passed is False
    # inspect:1 calls st-01's clean parts scratches; inspect:3 misses st-02's scratches.
    assert bright.delta is not None and bright.delta > 0.3
    assert dark.delta is not None and dark.delta < -0.1
    assert all(s.examples >= POLICY.min_examples for s in verdict.stations)
    rows = fh.db.query(
        "SELECT edge, model, count(*) AS n, min(length(stats)) AS stats FROM evaluations "
        "WHERE eval_id=? GROUP BY edge, model ORDER BY edge, model",
        (request.eval_id,),
    )
    assert [(r["edge"], r["model"]) for r in rows] == [
        (e, m) for e in EDGES for m in ("inspect:1", "inspect:3")
    ]
    assert all(r["stats"] > 20 for r in rows)  # image statistics, never images
    # Each held-out image also came as re-lit copies (for MPP), stored apart from it.
    copies = fh.db.query(
        "SELECT augmented, count(*) AS n FROM evaluations WHERE eval_id=? GROUP BY augmented",
        (request.eval_id,),
    )
    assert [r["augmented"] for r in copies] == [0, 1, 2]
    assert len({r["n"] for r in copies}) == 1  # every image with both copies
    shown = processes.cli("model", "gate", "inspect:3", "--show", expect=0)
    assert "NOT BLESSED" in shown.stdout and "fail" in shown.stdout, shown.stdout
    assert GRPC_EDGE in shown.stdout
    evidence = json.loads(processes.cli("model", "gate", "inspect:3", "--show", "--json").stdout)
    assert evidence["failed_stations"] == [GRPC_EDGE] and evidence["blessed"] is False

    # -- better everywhere: blessed, through the CLI, with recommended thresholds
    good = processes.cli(
        "model", "gate", "inspect:2", "--min-examples", "8", "--timeout", "40", expect=0
    )
    assert "BLESSED" in good.stdout and "NOT BLESSED" not in good.stdout, good.stdout
    stored = gating.stored(fh.db, "inspect", 2)
    assert stored is not None and stored.blessed
    thresholds = stored.evidence["recommended_thresholds"]
    assert set(thresholds) == {"default_threshold", "class_thresholds"}
    assert 0.0 < thresholds["class_thresholds"]["scratch"] <= 1.0


def test_a_report_reaches_a_manager_that_was_down_and_a_restart_repeats_nothing(
    plant: Plant,
) -> None:
    fh = plant.fh
    label_at_the_manager(plant)
    station = plant.agents[MQTT_EDGE]
    # Hold st-01's evaluation until the manager is down (the evaluation thread waits on
    # the same lock the test holds). Both models are already on the station (the one it
    # serves; the candidate put where a deployment leaves it): with the manager down there
    # is no gRPC to download a model from.
    with fh.fleet() as fleet:
        candidate = fleet.registry.get("inspect", 2).path
    target = fh.data_dir(MQTT_EDGE) / "models" / "inspect" / "2" / "model.onnx"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(candidate, target)
    with station.evaluations._lock:
        with fh.fleet() as fleet:
            request = gating.start(fleet, "inspect:2", [MQTT_EDGE])
        wait_until(
            lambda: fh.db.scalar(
                "SELECT published_at FROM desired WHERE kind='evaluate' AND edge=?", (MQTT_EDGE,)
            ),
            20,
            "the evaluation request to be published",
        )
        plant.service.stop()
    wait_until(lambda: station.counters["evaluate.done"], 30, "st-01 to finish its evaluation")
    assert gating.progress(fh.db, request).pending == (MQTT_EDGE,)  # the manager was down

    plant.service = ManagerService(fh.home)
    plant.service.start()
    state = wait_until(
        lambda: gating.progress(fh.db, request), 30, "the report", expect=lambda s: s.done
    )
    assert state.answered[MQTT_EDGE].status.value == "done"
    with fh.fleet() as fleet:
        verdict = gating.decide(fleet, request, POLICY)
    assert verdict.stations[0].examples >= POLICY.min_examples
    assert verdict.blessed, verdict.reason

    # A restarted station gets the retained request again: stale, not evaluated twice.
    station.stop()
    plant.agents[MQTT_EDGE] = restarted = start_agent(fh, MQTT_EDGE)
    wait_until(lambda: restarted.counters["evaluate.stale"], 20, "the retained request")
    assert restarted.counters["evaluate.done"] == 0
    assert fh.db.scalar("SELECT count(*) FROM evaluation_reports") == 1

    # A model the manager cannot serve: the station reports the failed download.
    with fh.fleet() as fleet:
        real = fleet.registry.get("inspect", 2).manifest
        ghost = fh.home.signing_key().sign(dataclasses.replace(real, version=99))
        version = int(fh.db.scalar("SELECT max(version) FROM desired WHERE kind='evaluate'")) + 1
        ask = EvaluationRequest(
            FLEET, MQTT_EDGE, version, "ev-ghost", (ghost.decode(),), fleet.grpc_target, 10
        )
        with fleet.store.transaction():
            fleet.write_desired(MQTT_EDGE, "evaluate", version, codec.encode(ask), 0.0)
    failed = wait_until(
        lambda: fh.row("SELECT * FROM evaluation_reports WHERE eval_id='ev-ghost'"),
        30,
        "the failed evaluation's report",
    )
    assert failed["status"] == "failed"
    assert failed["reason"].startswith("download_failed: inspect:99"), failed


# -- continuous training (fedge.loop.steps) on this plant: only the fleet job is
# replaced -- it "publishes" a model already in the registry (real fleet jobs run in
# tests/test_fleet_learns.py) -- so the loop's own wiring meets the real gate (the
# stations evaluate) and the real rollout (the serve loop moves the edges, canary first).

LOOP_JOB = '[job]\nname = "loop"\nrounds = 1\n\n[task]\nmodel = "inspect:1"\n'


def _publishes(monkeypatch: pytest.MonkeyPatch, ref: str) -> list[str]:
    started: list[str] = []

    def run(manifest: Path, job_dir: Path, home: ManagerHome, **_: Any) -> FleetJobResult:
        started.append(manifest.read_text())
        return FleetJobResult("r", JobState.COMPLETED, 1, 1, ref)

    monkeypatch.setattr(fleet_job, "run_fleet_job", run)
    return started


def _runner(plant: Plant) -> LoopRunner:
    policy = LoopPolicy(
        model="inspect",
        job=LOOP_JOB,
        min_new_labels=10,
        canary=(MQTT_EDGE,),
        waves="100%",
        health_window="1s",
        abort_if="failed_activation>0",
        cooldown_s=0.0,
    )
    run_store.save_policy(plant.fh.db, policy)
    wiring = manager_wiring(plant.fh.home, gate_policy=POLICY, gate_timeout_s=60)
    return LoopRunner(plant.fh.home, wiring)


def test_new_labels_lead_to_a_blessed_model_rolled_out_canary_first(
    plant: Plant, monkeypatch: pytest.MonkeyPatch
) -> None:
    label_at_the_manager(plant)  # 2 x 24 labelled parts on inspect:1
    jobs = _publishes(monkeypatch, "inspect:2")
    (run,) = _runner(plant).tick()
    assert run.state is RunState.COMPLETED, run.reason
    assert 'model = "inspect:1"' in jobs[0]  # the job starts from the serving model
    fh = plant.fh
    for edge in EDGES:
        wait_until(
            functools.partial(lambda e: fh.edge_row(e)["serving"], edge),
            10,
            f"{edge} on inspect:2",
            expect=lambda s: s == "inspect:2",
        )
    moved = fh.db.query(
        "SELECT edge, wave FROM rollout_edges WHERE rollout_id=? ORDER BY wave, edge",
        (run.rollout_id,),
    )
    assert moved[0] == {"edge": MQTT_EDGE, "wave": 0}  # the canary first
    steps = [e["step"] for e in run_store.events(fh.db, run.run_id)]
    assert steps == ["triggered", "published", "gated", "rollout_started", "rollout_ended"]
    assert run_store.observe(fh.db, "inspect").new_labels == 0  # used: nothing due now


def test_a_candidate_worse_on_a_station_is_never_rolled_out(
    plant: Plant, monkeypatch: pytest.MonkeyPatch
) -> None:
    label_at_the_manager(plant)
    _publishes(monkeypatch, "inspect:3")  # worse on st-02 (see test_gate_flow)
    (run,) = _runner(plant).tick()
    assert run.state is RunState.NOT_BLESSED and "st-02" in run.reason, run.reason
    assert plant.fh.db.scalar("SELECT count(*) FROM rollouts") == 0
    assert {plant.fh.edge_row(e)["serving"] for e in EDGES} == {"inspect:1"}

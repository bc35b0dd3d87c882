"""The fleet learns: stations train on their own labelled images as Flower parties.

Real processes throughout: Mosquitto (``manager broker``), ``manager serve``, the fleet's
SuperLink (``manager superlink``), three ``agent run`` processes -- two with training
enabled in their signed config, so each supervises its own ``flower-supernode`` -- and
``fedge aggregator run`` on a fleet job manifest, which submits fedge's ServerApp to the
SuperLink with ``flwr run``. Stations score images through their local HTTP API (which
keeps them on the station), an operator labels them there, and the job trains on them.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    FleetHome,
    Processes,
    dump_flower_logs,
    make_fleet_home,
    score_and_label,
    start_training_plant,
    wait_config_applied,
    wait_serving,
    wait_until,
)

from fedge.aggregator.jobs.checkpoint import load_arrays
from fedge.aggregator.jobs.run_store import RunStore
from fedge.datasets.defects import CLASSES
from fedge.edge_manager.registry.versions import TrainableSource
from fedge.models.inspection import export_onnx, new_model
from fedge.party.families import state_arrays, weights_bytes
from fedge.party.station_store import is_holdout
from fedge.protocols.config import TrainingPolicy
from fedge.protocols.manifest import Preprocess

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02", "st-03")
TRAINING = ("st-01", "st-02")  # st-03 keeps training disabled
HOLDOUT_PERCENT = 20  # the agent's default share
WIDTH = 4


def publish_trainable(fh: FleetHome, tmp_path: Path) -> None:
    """inspect:1: a fresh width-4 CNN, its ONNX and its trainable weights."""
    model = new_model(0, width=WIDTH)
    onnx = tmp_path / "inspect-1.onnx"
    export_onnx(model, onnx)
    weights = tmp_path / "inspect-1.npz"
    weights.write_bytes(weights_bytes(state_arrays(model)))
    with fh.fleet() as fleet:
        fleet.registry.publish(
            onnx,
            name="inspect",
            version=1,
            classes=CLASSES,
            positive_classes=("scratch",),
            preprocess=Preprocess(image_size=32),
            trainable=TrainableSource(weights, "inspection-cnn", {"width": WIDTH}),
        )


def write_job(path: Path, rounds: int = 2) -> Path:
    path.write_text(
        f"""
[job]
name = "fleet-test"
rounds = {rounds}
seed = 0

[task]
model = "inspect:1"
lr = 0.003
local_epochs = 2
batch_size = 8

[strategy]
kind = "tiered"
[strategy.params]
tiers = 2

[federation]
backend = "fleet"
fleet = "plant-a"
edges = "all"
node_wait_s = 240.0
round_timeout_s = 300.0
eval_timeout_s = 240.0
""",
        encoding="utf-8",
    )
    return path


# Real processes and several rounds: the test's own waits, which say what they waited
# for, should decide that it hung, not pytest's 300 s default.
@pytest.mark.timeout(900)
def test_stations_train_as_federated_parties_and_the_job_publishes(
    tmp_path: Path, processes: Processes
) -> None:
    # The job trains without DP-SGD: its stations opt out of a privacy floor, explicitly.
    fh = make_fleet_home(tmp_path, edges=EDGES, privacy_floor=False)
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    publish_trainable(fh, tmp_path)
    try:
        ports = start_training_plant(fh, processes, tmp_path, EDGES)
        with fh.fleet() as fleet:
            fleet.deploy("inspect", 1, list(EDGES))
            pushed = fleet.set_training(list(TRAINING), TrainingPolicy(enabled=True, threads=1))
        for edge in EDGES:
            wait_serving(fh, edge, "inspect:1")
        for p in pushed:
            wait_config_applied(fh, p.edge, p.version, timeout_s=30)
        labelled = {edge: score_and_label(ports[edge], seed=40 + i) for i, edge in enumerate(EDGES)}
        # The images stay on the station, joined to their labels by prediction id.
        for edge in EDGES:
            status = json.loads(urllib.request.urlopen(
                f"http://127.0.0.1:{ports[edge]}/v1/status", timeout=5).read())  # fmt: skip
            assert status["station"]["labelled"] == len(labelled[edge]), status
        trains = {
            edge: sum(not is_holdout(pid, HOLDOUT_PERCENT) for pid in labelled[edge])
            for edge in TRAINING
        }

        job_dir = tmp_path / "job"
        result = processes.cli(
            "aggregator", "run", str(write_job(tmp_path / "job.toml")), "--dir", str(job_dir),
            timeout_s=600,
        )  # fmt: skip
        assert "published inspect:2" in result.stdout, result.stdout

        store = RunStore(job_dir / "runs.db")
        try:
            run_id = str(store.runs()[-1]["run_id"])
            run = store.run(run_id)
            rounds = store.rounds(run_id)
            names = store.party_names(run_id)
            party_rounds = store.party_metrics(run_id)
            evaluations = store.evaluations(run_id)
        finally:
            store.close()
        assert run is not None and run["state"] == "completed"
        assert [r["round"] for r in rounds] == [1, 2]
        assert set(names.values()) == set(TRAINING)  # st-03 is never a party
        for r in rounds:
            assert {names[p] for p in r["selected"]} <= set(TRAINING), r
        # Each party trained on exactly its labelled, not held-out, images.
        assert party_rounds, "no party reported"
        for row in party_rounds:
            edge = names[row["party"]]
            assert row["metrics"]["num-examples"] == trains[edge], row
        # Every training station evaluated the starting model and each round's model.
        by_round: dict[int, set[str]] = {}
        for e in evaluations:
            if e["accuracy"] is not None:
                by_round.setdefault(e["round"], set()).add(e["party"])
        # (On failure, say why a station did not evaluate: it is the whole diagnosis.)
        errors = [(e["round"], e["party"], e["error"]) for e in evaluations if e["error"]]
        assert by_round == {0: set(TRAINING), 1: set(TRAINING), 2: set(TRAINING)}, errors

        status = json.loads(
            processes.cli("aggregator", "status", "--dir", str(job_dir), "--json").stdout
        )
        assert {(e["round"], e["party"]) for e in status[0]["evaluations"]} == {
            (r, edge) for r in (0, 1, 2) for edge in TRAINING
        }

        initial = load_arrays(job_dir / "initial.npz")
        final = load_arrays(job_dir / "final.npz")
        assert any(not np.array_equal(initial[k], final[k]) for k in initial)

        with fh.fleet() as fleet:
            published = fleet.registry.get("inspect", 2)
        lineage = published.manifest.lineage
        assert lineage.parent_version == 1 and lineage.run_id == run_id
        assert lineage.data is not None
        for edge in TRAINING:
            assert f"{edge}={trains[edge]}" in lineage.data
        assert published.manifest.trainable is not None
        assert published.manifest.preprocess == Preprocess(image_size=32)
        # Every agent is still up; the stations that train run a SuperNode.
        for edge in EDGES:
            status = json.loads(urllib.request.urlopen(
                f"http://127.0.0.1:{ports[edge]}/v1/status", timeout=5).read())  # fmt: skip
            assert status["training"]["running"] is (edge in TRAINING), status
    except BaseException:
        for proc in processes.procs:
            print(proc.output()[-3000:])
        dump_flower_logs(tmp_path)
        raise


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# Real processes and several rounds: the test's own waits, which say what they waited
# for, should decide that it hung, not pytest's 300 s default.
@pytest.mark.timeout(900)
def test_a_killed_agent_and_a_killed_aggregator_lose_no_round(
    tmp_path: Path, processes: Processes
) -> None:
    """SIGKILL a training station mid-round, then the aggregator: the job still ends right.

    The round with the dead station ends by its quorum; the station's SuperNode dies with
    its agent and comes back with it. The ServerApp (the aggregator) is SIGKILLed after
    round 2; ``fedge aggregator run`` says so, and ``resume`` continues from the round-2
    checkpoint: every round recorded once, the job published.
    """
    # The job trains without DP-SGD: its stations opt out of a privacy floor, explicitly.
    fh = make_fleet_home(tmp_path, edges=EDGES, privacy_floor=False)
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    publish_trainable(fh, tmp_path)
    try:
        ports = start_training_plant(fh, processes, tmp_path, EDGES)
        with fh.fleet() as fleet:
            fleet.deploy("inspect", 1, list(EDGES))
            pushed = fleet.set_training(list(TRAINING), TrainingPolicy(enabled=True))
        for edge in EDGES:
            wait_serving(fh, edge, "inspect:1")
        for p in pushed:
            wait_config_applied(fh, p.edge, p.version, timeout_s=30)
        for i, edge in enumerate(TRAINING):
            score_and_label(ports[edge], seed=60 + i)
        manifest = write_job(tmp_path / "job.toml", rounds=3)
        text = manifest.read_text().replace(
            'kind = "tiered"\n[strategy.params]\ntiers = 2',
            'kind = "fedavg"\n[strategy.params]\nquorum_fraction = 0.5',
        )
        manifest.write_text(text)
        job_dir = tmp_path / "job"
        runner = processes.start(
            "aggregator", "aggregator", "run", str(manifest), "--dir", str(job_dir)
        )

        def store_view() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            store = RunStore(job_dir / "runs.db")
            try:
                runs = store.runs()
                run_id = str(runs[-1]["run_id"]) if runs else ""
                return store.rounds(run_id), store.evaluations(run_id)
            finally:
                store.close()

        # Round 1 starts right after every station evaluated the starting model.
        wait_until(store_view, 240, "round-0 evaluations", expect=lambda v: len(v[1]) >= 2)
        victim = next(p for p in processes.procs if p.name == "st-02")
        supernode_pid = int((fh.data_dir("st-02") / "supernode" / "supernode.pid").read_text())
        processes.kill(victim)
        wait_until(lambda: not pid_alive(supernode_pid), 20, "st-02's SuperNode to die with it")
        rounds, _ = wait_until(store_view, 300, "round 1 to end", expect=lambda v: len(v[0]) >= 1)
        assert rounds[0]["quorum_met"], rounds[0]

        # The agent comes back, and its SuperNode with it.
        processes.start("st-02", "agent", "run", "--config", str(fh.agents["st-02"]))

        def st02_training() -> object:
            url = f"http://127.0.0.1:{ports['st-02']}/v1/status"
            return json.loads(urllib.request.urlopen(url, timeout=5).read())["training"]

        wait_until(st02_training, 60, "st-02's SuperNode back", expect=lambda t: t["running"])  # type: ignore[index]

        # Kill the aggregator (the ServerApp holds the job lock) once round 2 is recorded.
        wait_until(store_view, 300, "round 2 to end", expect=lambda v: len(v[0]) >= 2)
        server_pid = int((job_dir / ".lock").read_text().strip())
        assert pid_alive(server_pid)
        os.kill(server_pid, signal.SIGKILL)
        code = wait_until(
            runner.popen.poll, 120, "`aggregator run` to notice", expect=lambda c: c is not None
        )
        assert code == 1, runner.output()
        assert "resume" in runner.output()

        result = processes.cli("aggregator", "resume", "--dir", str(job_dir), timeout_s=600)
        assert "published inspect:2" in result.stdout, result.stdout
        rounds, evaluations = store_view()
        assert [r["round"] for r in rounds] == [1, 2, 3]
        assert {e["round"] for e in evaluations} == {0, 1, 2, 3}
        # A second resume has nothing to do and publishes nothing twice.
        again = processes.cli("aggregator", "resume", "--dir", str(job_dir), timeout_s=120)
        assert "published inspect:2" in again.stdout
        with fh.fleet() as fleet:
            assert fleet.registry.latest_version("inspect") == 2
    except BaseException:
        for proc in processes.procs:
            print(proc.output()[-3000:])
        dump_flower_logs(tmp_path)
        raise

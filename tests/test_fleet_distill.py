"""The slow tier's stations get the compact student (issue 32, item 7).

Real processes throughout, as in test_fleet_learns: Mosquitto, ``manager serve``, the
fleet's SuperLink, three agents with training enabled (each supervising its own
``flower-supernode``) and ``fedge aggregator run`` on a tier job: two TiFL tiers, the
fast one training ``cnn`` (width 8), the slow one ``cnn-small`` (width 4), fused on the
server's unlabeled proxy images by the simulator's FedDF strategy (``distill``), or
trained as a slice of the width-8 model itself (``nested``, HeteroFL). The job publishes
one model per tier and deploys each to its tier's stations: afterwards every station
serves its own tier's architecture.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

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
)

from fedge.aggregator.jobs.run_store import RunStore
from fedge.datasets.defects import CLASSES, make_defect_images, write_png_dir
from fedge.edge_manager.registry.versions import TrainableSource
from fedge.models.inspection import export_onnx, new_model
from fedge.party.families import state_arrays, weights_bytes
from fedge.protocols.config import TrainingPolicy
from fedge.protocols.manifest import Preprocess

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02", "st-03")
WIDTHS = {"cnn": 8, "cnn-small": 4}


def publish_teacher(fh: FleetHome, tmp_path: Path) -> None:
    """inspect:1: a fresh width-8 CNN (the largest tier architecture, ``cnn``)."""
    model = new_model(0, width=WIDTHS["cnn"])
    export_onnx(model, tmp_path / "inspect-1.onnx")
    weights = tmp_path / "inspect-1.npz"
    weights.write_bytes(weights_bytes(state_arrays(model)))
    with fh.fleet() as fleet:
        fleet.registry.publish(
            tmp_path / "inspect-1.onnx", name="inspect", version=1, classes=CLASSES,
            positive_classes=("scratch",), preprocess=Preprocess(image_size=32),
            trainable=TrainableSource(weights, "inspection-cnn", {"width": WIDTHS["cnn"]}),
        )  # fmt: skip


def write_job(path: Path, kind: str) -> Path:
    distill = ""
    if kind == "distill":
        images, _ = make_defect_images(32, seed=5)
        write_png_dir(images, path.parent / "proxy", "proxy")
        distill = '\ndistill_epochs = 2\n\n[distill]\nproxy = "proxy"'
    path.write_text(
        f"""
[job]
name = "fleet-{kind}"
rounds = 2
seed = 0

[task]
model = "inspect:1"
local_epochs = 1
batch_size = 8

[federation]
backend = "fleet"
fleet = "plant-a"
edges = "all"
node_wait_s = 240.0
round_timeout_s = 300.0
eval_timeout_s = 240.0

[strategy]
kind = "{kind}"
[strategy.params]
tiers = 2
tier_archs = ["cnn", "cnn-small"]{distill}
""",
        encoding="utf-8",
    )
    return path


def status(port: int) -> dict[str, object]:
    url = f"http://127.0.0.1:{port}/v1/status"
    result: dict[str, object] = json.loads(urllib.request.urlopen(url, timeout=5).read())
    return result


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["distill", "nested"])
def test_each_tier_serves_its_own_architecture_after_a_tier_job(
    tmp_path: Path, processes: Processes, kind: str
) -> None:
    fh = make_fleet_home(tmp_path, edges=EDGES, privacy_floor=False)
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    publish_teacher(fh, tmp_path)
    try:
        ports = start_training_plant(fh, processes, tmp_path, EDGES)
        with fh.fleet() as fleet:
            fleet.deploy("inspect", 1, list(EDGES))
            pushed = fleet.set_training(list(EDGES), TrainingPolicy(enabled=True, threads=1))
        for edge in EDGES:
            wait_serving(fh, edge, "inspect:1")
        for p in pushed:
            wait_config_applied(fh, p.edge, p.version, timeout_s=30)
        for i, edge in enumerate(EDGES):
            score_and_label(ports[edge], seed=80 + i)

        job_dir = tmp_path / "job"
        result = processes.cli(
            "aggregator", "run", str(write_job(tmp_path / "job.toml", kind)), "--dir", str(job_dir),
            timeout_s=600,
        )  # fmt: skip
        assert "published inspect-cnn:1, inspect-cnn-small:1" in result.stdout, result.stdout

        # The stations trained the architecture of their tier: round 1 (TiFL's profiling)
        # everyone the largest; round 2 the drawn tier's.
        store = RunStore(job_dir / "runs.db")
        try:
            run_id = str(store.runs()[-1]["run_id"])
            assert store.run(run_id)["state"] == "completed"  # type: ignore[index]
            assert len(store.rounds(run_id)) == 2
        finally:
            store.close()
        tiers = json.loads((job_dir / "tier-models.json").read_text())
        assert tiers["tier_archs"] == ["cnn", "cnn-small"]
        stations: dict[str, str] = tiers["stations"]
        assert set(stations) == set(EDGES)
        # Three stations in two tiers: the fast tier has two (TiFL's balanced sizes).
        assert sorted(stations.values()) == ["cnn", "cnn", "cnn-small"], stations

        with fh.fleet() as fleet:
            for arch, width in WIDTHS.items():
                published = fleet.registry.get(f"inspect-{arch}", 1)
                trainable = published.manifest.trainable
                assert trainable is not None and trainable.params["width"] == width
                assert published.manifest.lineage.run_id == run_id
                assert published.manifest.lineage.note.startswith(f"{kind} job fleet-{kind}")
        if kind == "nested":
            # The slow tier's model is the final global model's leading slice, exactly.
            final = dict(np.load(job_dir / "final.npz"))
            small = dict(np.load(job_dir / "final-cnn-small.npz"))
            assert set(small) == set(final)
            for key, value in small.items():
                np.testing.assert_array_equal(value, final[key][tuple(map(slice, value.shape))])
        # Each station serves its own tier's model, and says so.
        for edge, arch in stations.items():
            wait_serving(fh, edge, f"inspect-{arch}:1")
            assert status(ports[edge])["serving"] == f"inspect-{arch}:1", edge
        # A second resume publishes and deploys nothing twice.
        again = processes.cli("aggregator", "resume", "--dir", str(job_dir), timeout_s=120)
        assert "inspect-cnn:1, inspect-cnn-small:1" in again.stdout, again.stdout
        with fh.fleet() as fleet:
            assert fleet.registry.latest_version("inspect-cnn") == 1
            assert fleet.registry.latest_version("inspect-cnn-small") == 1
    except BaseException:
        for proc in processes.procs:
            print(proc.output()[-3000:])
        dump_flower_logs(tmp_path)
        raise

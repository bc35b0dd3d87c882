"""A fleet job is checked against the manager's store before anything is written."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home

from fedge.aggregator.fleet.manifest import parse_fleet_manifest
from fedge.aggregator.jobs.spec import ManifestError
from fedge.datasets.defects import CLASSES
from fedge.edge_manager.registry.versions import TrainableSource
from fedge.federation.prepare import prepare
from fedge.models.inspection import export_onnx, new_model
from fedge.party.families import state_arrays, weights_bytes
from fedge.protocols.config import TrainingPolicy
from fedge.protocols.manifest import Preprocess

JOB = """
[job]
name = "bad-input"
rounds = 2

[task]
model = "{model}"

[strategy]
kind = "fedavg"

[federation]
backend = "fleet"
fleet = "{fleet}"
edges = {edges}
"""


def job(tmp_path: Path, *, model: str = "inspect:1", fleet: str = "plant-a",
        edges: str = '"all"', extra: str = "") -> Path:  # fmt: skip
    path = tmp_path / "job.toml"
    text = JOB.format(model=model, fleet=fleet, edges=edges) + extra.replace("x = 1\n", "")
    path.write_text(text + "\n", encoding="utf-8")
    return path


@pytest.fixture
def home(tmp_path: Path) -> Iterator[FleetHome]:
    fh = make_fleet_home(tmp_path / "fleet", edges=("st-01", "st-02"))
    model = new_model(0, width=4)
    export_onnx(model, tmp_path / "m.onnx")
    (tmp_path / "m.npz").write_bytes(weights_bytes(state_arrays(model)))
    with fh.fleet() as fleet:
        fleet.registry.publish(
            tmp_path / "m.onnx", name="inspect", version=1, classes=CLASSES,
            preprocess=Preprocess(32),
            trainable=TrainableSource(tmp_path / "m.npz", "inspection-cnn", {"width": 4}),
        )  # fmt: skip
        fleet.registry.publish(tmp_path / "m.onnx", name="plain", version=1, classes=CLASSES)
        # Weights of another width than the family params say: nothing could train them.
        fleet.registry.publish(
            tmp_path / "m.onnx", name="misfit", version=1, classes=CLASSES,
            preprocess=Preprocess(32),
            trainable=TrainableSource(tmp_path / "m.npz", "inspection-cnn", {"width": 8}),
        )  # fmt: skip
        fleet.set_training(["st-01"], TrainingPolicy(enabled=True))
    yield fh
    fh.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"edges": '["st-01", "st-77"]'}, "unknown edge.*st-77"),
        ({"edges": '["st-01", "st-02"]'}, "training is disabled on st-02"),
        ({"model": "inspect:9"}, "inspect:9 is not in the registry"),
        ({"model": "plain:1"}, "plain:1 cannot be trained"),
        ({"fleet": "plant-b"}, "this manager home runs fleet 'plant-a'"),
        ({"model": "inspect"}, "task.model must look like NAME:VERSION"),
        ({"model": "misfit:1"}, "weights do not fit the model"),
        ({"extra": "min_parties = 2"}, "federation.min_parties is 2, but only 1 edge"),
        ({"extra": 'x = 1\n[publish]\nname = "../../evil"'}, "publish.name"),
    ],
)
def test_bad_fleet_jobs_are_refused_and_create_nothing(
    tmp_path: Path, home: FleetHome, overrides: dict[str, str], message: str
) -> None:
    job_dir = tmp_path / "job"
    with pytest.raises(ManifestError, match=message):
        prepare(job(tmp_path, **overrides), job_dir, home.home)
    assert not job_dir.exists()


def test_a_good_job_names_only_training_stations(tmp_path: Path, home: FleetHome) -> None:
    job_dir = tmp_path / "job"
    prepare(job(tmp_path), job_dir, home.home)
    assert (job_dir / "parties.json").read_text().split() == ["{", '"st-01":', "1000", "}"]
    assert (job_dir / "runs.db").exists() and (job_dir / "app" / "pyproject.toml").exists()
    with pytest.raises(Exception, match="already holds a job"):
        prepare(job(tmp_path), job_dir, home.home)


def test_fleet_manifests_name_the_bad_field() -> None:
    good = JOB.format(model="inspect:1", fleet="plant-a", edges='"all"')
    assert parse_fleet_manifest(good).federation.edges == "all"
    with pytest.raises(ManifestError, match="distill"):
        parse_fleet_manifest(good.replace('"fedavg"', '"distill"'))
    with pytest.raises(ManifestError, match=r"federation\.edges"):
        parse_fleet_manifest(good.replace('edges = "all"', "edges = []"))
    with pytest.raises(ManifestError, match="names an edge twice"):
        parse_fleet_manifest(good.replace('edges = "all"', 'edges = ["a", "a"]'))
    with pytest.raises(ManifestError, match="quorum"):
        parse_fleet_manifest(good + "\n[strategy.params]\nquorum_fraction = 7\n")

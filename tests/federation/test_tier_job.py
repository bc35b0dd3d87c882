"""A distill fleet job is checked against the fleet and the model's family before anything
is written (issue 32, item 7): bad tiers, architectures or proxy images create nothing."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import FleetHome, make_fleet_home

from fedge.aggregator.jobs.spec import ManifestError
from fedge.datasets.defects import CLASSES, make_defect_images, write_png_dir
from fedge.edge_manager.registry.versions import TrainableSource
from fedge.federation.prepare import prepare
from fedge.models.inspection import export_onnx, new_model
from fedge.party.families import state_arrays, weights_bytes
from fedge.protocols.config import TrainingPolicy
from fedge.protocols.manifest import Preprocess

JOB = """
[job]
name = "tiers"
rounds = 2

[task]
model = "{model}"

[strategy]
kind = "distill"
[strategy.params]
tiers = {tiers}
tier_archs = {archs}

[federation]
backend = "fleet"
fleet = "plant-a"
edges = "all"

[distill]
proxy = "{proxy}"
"""


@pytest.fixture
def home(tmp_path: Path) -> Iterator[FleetHome]:
    fh = make_fleet_home(tmp_path / "fleet", edges=("st-01", "st-02"))
    with fh.fleet() as fleet:
        for width, name in ((16, "large"), (4, "small")):
            model = new_model(0, width=width)
            export_onnx(model, tmp_path / f"{name}.onnx")
            (tmp_path / f"{name}.npz").write_bytes(weights_bytes(state_arrays(model)))
            fleet.registry.publish(
                tmp_path / f"{name}.onnx", name=name, version=1, classes=CLASSES,
                preprocess=Preprocess(32),
                trainable=TrainableSource(tmp_path / f"{name}.npz", "inspection-cnn",
                                          {"width": width}),
            )  # fmt: skip
        fleet.set_training(["st-01", "st-02"], TrainingPolicy(enabled=True))
    images, _ = make_defect_images(6, seed=3)
    write_png_dir(images, tmp_path / "proxy", "part")
    (tmp_path / "empty").mkdir()
    yield fh
    fh.close()


def job(tmp_path: Path, *, model: str = "large:1", tiers: int = 2,
        archs: str = '["cnn-large", "cnn-small"]', proxy: str = "proxy") -> Path:  # fmt: skip
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(model=model, tiers=tiers, archs=archs, proxy=proxy))
    return path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"archs": '["cnn-large", "cnn-huge"]'}, "unknown inspection-cnn architecture.*cnn-huge"),
        ({"tiers": 3, "archs": '["cnn-large", "cnn", "cnn-small"]'}, "a tier would have no"),
        ({"model": "small:1"}, "must be the largest tier architecture's \\(cnn-large\\)"),
        ({"proxy": "missing"}, "distill.proxy: .*missing is not a directory"),
        ({"proxy": "empty"}, "distill.proxy: .*holds no images"),
    ],
)
def test_bad_distill_jobs_are_refused_and_create_nothing(
    tmp_path: Path, home: FleetHome, overrides: dict[str, object], message: str
) -> None:
    job_dir = tmp_path / "job"
    with pytest.raises(ManifestError, match=message):
        prepare(job(tmp_path, **overrides), job_dir, home.home)  # type: ignore[arg-type]
    assert not job_dir.exists()


def test_a_distill_job_gets_its_proxy_and_the_tier_server(tmp_path: Path, home: FleetHome) -> None:
    job_dir = tmp_path / "job"
    prepare(job(tmp_path), job_dir, home.home)
    proxy = np.load(job_dir / "proxy.npy")
    assert proxy.shape == (6, 1, 32, 32) and proxy.dtype == np.float32
    app = (job_dir / "app" / "pyproject.toml").read_text()
    assert 'serverapp = "fedge.federation.tier_server:app"' in app


def test_a_nested_job_gets_the_tier_server_and_no_proxy(tmp_path: Path, home: FleetHome) -> None:
    text = JOB.format(model="large:1", tiers=2, archs='["cnn-large", "cnn-small"]', proxy="")
    path = tmp_path / "nested.toml"
    path.write_text(text.replace('kind = "distill"', 'kind = "nested"').split("[distill]")[0])
    job_dir = tmp_path / "job"
    prepare(path, job_dir, home.home)
    assert not (job_dir / "proxy.npy").exists()
    app = (job_dir / "app" / "pyproject.toml").read_text()
    assert 'serverapp = "fedge.federation.tier_server:app"' in app


def test_a_nested_job_whose_weights_are_not_the_largest_is_refused(
    tmp_path: Path, home: FleetHome
) -> None:
    text = JOB.format(model="small:1", tiers=2, archs='["cnn-large", "cnn-small"]', proxy="")
    path = tmp_path / "nested.toml"
    path.write_text(text.replace('kind = "distill"', 'kind = "nested"').split("[distill]")[0])
    job_dir = tmp_path / "job"
    with pytest.raises(ManifestError, match="must be the largest tier architecture's"):
        prepare(path, job_dir, home.home)
    assert not job_dir.exists()

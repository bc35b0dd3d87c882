"""An anomaly job on real SuperNodes: each station's statistics counted once, one sum.

Real processes: a ``flower-superlink`` (:class:`~fedge.aggregator.superlink.link.
SuperLink`), one plain ``flower-supernode`` per station on its own data directory (a
real SQLite store and PNG files), the station's anomaly ClientApp
(:mod:`fedge.party.anomaly_app`) and the anomaly ServerApp
(:mod:`fedge.aggregator.anomaly.server`) submitted with ``flwr run``. Station st-03 has
no good parts: its error reply is recorded, and the others' statistics still make the
model. Not covered here: the fleet job's manifest, signing and publishing path.
"""

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedge.aggregator.superlink.link import SuperLink
from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.models.anomaly.backbone import InspectionBackbone
from fedge.models.anomaly.model import extract_features
from fedge.models.anomaly.statistics import fit, fit_from_arrays, mahalanobis, station_statistics
from fedge.models.inspection import new_model
from fedge.party import trainer
from fedge.party.station_store import Retention, StationData
from fedge.protocols.manifest import Preprocess
from fedge.protocols.model_spec import ModelSpec
from fedge.transport.ports import free_port

pytestmark = pytest.mark.integration

SPEC = ModelSpec("inspection-cnn", {"width": 4}, CLASSES, Preprocess(image_size=32))
STATIONS = {"st-01": (60, 0.5), "st-02": (30, 0.5), "st-03": (8, 1.0)}  # images, defect share


def _png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _keep(data_dir: Path, edge: str, n: int, defects: float, seed: int) -> None:
    data = StationData(data_dir, Retention(holdout_percent=25))
    images, labels = make_defect_images(n, seed=seed, scratch_fraction=defects)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        pid = f"{edge}-{index:04d}"
        data.keep(pid, _png(image), ".png", at=time.time() + index)
        data.label(pid, CLASSES[int(label)], at=float(index))
    data.close()


def _good_training_images(data_dir: Path) -> np.ndarray:
    data = StationData(data_dir, Retention(holdout_percent=25), readonly=True)
    try:
        chosen = [i for i in data.labelled() if i.label == "clean" and not i.holdout]
    finally:
        data.close()
    return trainer.load_examples(chosen, ("clean",), SPEC.preprocess).x


def _supernode(root: Path, edge: str, superlink: str) -> subprocess.Popen[bytes]:
    flwr_home = root / "flwr" / edge
    flwr_home.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    with open(root / f"supernode-{edge}.log", "ab") as log:
        return subprocess.Popen(
            [
                str(bin_dir / "flower-supernode"), "--insecure", "--superlink", superlink,
                "--port", str(free_port()), "--node-config",
                f'edge="{edge}" data-dir="{root / edge}" holdout-percent=25 threads=1',
            ],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def _app(root: Path, initial: Path, out: Path) -> Path:
    app = root / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(
        "\n".join(
            [
                "[build-system]",
                'requires = ["hatchling"]',
                'build-backend = "hatchling.build"',
                "[project]",
                'name = "anomaly-job"',
                'version = "1.0.0"',
                'license = "Apache-2.0"',
                "dependencies = []",
                "[tool.flwr.app]",
                'publisher = "fedge"',
                "[tool.flwr.app.components]",
                'serverapp = "fedge.aggregator.anomaly.server:app"',
                'clientapp = "fedge.party.anomaly_app:app"',
                "[tool.flwr.app.config]",
                f"initial = {json.dumps(str(initial))}",
                f"model-spec = {json.dumps(SPEC.to_json())}",
                f"nodes = {len(STATIONS)}",
                f"out = {json.dumps(str(out))}",
                "timeout-s = 240",
                # A handful of held-out good parts per station: a conformal threshold at
                # 25 % needs 3 (at the default 1 %, 99).
                '"anomaly-false-alarm-rate" = 0.25',
                "",
            ]
        )
    )
    return app


@pytest.mark.timeout(600)
def test_an_anomaly_job_adds_every_stations_statistics_once(tmp_path: Path) -> None:
    for seed, (edge, (n, defects)) in enumerate(STATIONS.items()):
        _keep(tmp_path / edge, edge, n, defects, seed=40 + seed)
    backbone_net = new_model(0, width=4)
    initial = tmp_path / "initial.npz"
    np.savez(initial, **{k: v.numpy() for k, v in backbone_net.state_dict().items()})
    out = tmp_path / "out"
    superlink = SuperLink(tmp_path / "superlink", "127.0.0.1", free_port())
    superlink.start()
    nodes = []
    try:
        nodes = [_supernode(tmp_path, edge, superlink.address) for edge in STATIONS]
        cli_home = tmp_path / "cli"
        cli_home.mkdir()
        (cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "t"\n\n[superlink.t]\naddress = "{superlink.local_address}"'
            "\ninsecure = true\n"
        )
        env = {**os.environ, "FLWR_HOME": str(cli_home), "FLWR_TELEMETRY_ENABLED": "0"}
        flwr = str(Path(sys.executable).parent / "flwr")
        submitted = subprocess.run(
            [flwr, "run", str(_app(tmp_path, initial, out)), "t", "--format", "json"],
            capture_output=True, text=True, env=env, timeout=180, check=False,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        result_path = out / "result.json"
        end = time.monotonic() + 400
        while not result_path.exists() and time.monotonic() < end:
            time.sleep(0.5)
        time.sleep(0.2)  # written in one call; let the writer close it
        result = json.loads(result_path.read_text())
        assert "error" not in result, result

        # Every station with good parts counted once, with exactly its good parts.
        expected = {e: len(_good_training_images(tmp_path / e)) for e in ("st-01", "st-02")}
        assert result["good_parts"] == expected
        assert result["total_good_parts"] == sum(expected.values())
        assert "no good parts" in result["failures"]["st-03"]
        assert result["duplicates"] == []

        # The model equals the fit on the pooled good parts.
        with np.load(out / "model.npz") as npz:
            model = fit_from_arrays({k: npz[k] for k in npz.files})
        backbone = InspectionBackbone(backbone_net).eval()
        pooled_images = np.concatenate([_good_training_images(tmp_path / e) for e in expected])
        features, grid = extract_features(backbone, pooled_images)
        pooled = fit(station_statistics(features, grid))
        np.testing.assert_allclose(model.mean, pooled.mean, rtol=0, atol=1e-9)
        np.testing.assert_allclose(model.covariance, pooled.covariance, rtol=0, atol=1e-9)

        # Thresholds from each station's held-out good parts (st-03 has none).
        for edge in expected:
            metrics = result["thresholds"][edge]
            assert metrics["anomaly-threshold"] > 0 and metrics["holdout-examples"] >= 3
        assert "error" in result["thresholds"]["st-03"]

        # Held-out dents score above held-out good parts at every station's data.
        for seed, edge in enumerate(STATIONS):
            good, _ = make_defect_images(30, seed=500 + seed, scratch_fraction=0.0)
            dents, _ = make_defect_images(30, seed=600 + seed, dent_fraction=1.0,
                                          scratch_fraction=1.0)  # fmt: skip
            with torch.no_grad():
                good_scores = mahalanobis(model, extract_features(backbone, good)[0]).max(1)
                dent_scores = mahalanobis(model, extract_features(backbone, dents)[0]).max(1)
            assert np.median(dent_scores) > np.median(good_scores), edge
    except BaseException:
        for log in sorted(tmp_path.rglob("*.log")):
            print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            try:
                node.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait(timeout=10)
        superlink.stop()

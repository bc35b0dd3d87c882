"""A distilled student goes the whole way: registry -> real broker -> agent -> predictions.

Mosquitto (``manager broker``), ``manager serve`` and one agent run as separate processes.
A small inspection CNN is trained and served as ``inspect:1``; it is distilled into a
compact student on unlabeled generated images, published as ``inspect:2`` with its
lineage, deployed, and the images dropped afterwards must be scored by the student: the
prediction records carry ``inspect:2`` and the student's own probabilities.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import FleetHome, Processes, make_fleet_home, port_open, wait_until

from fedge.datasets.defects import CLASSES, make_defect_images, write_png_dir
from fedge.models.inspection import (
    InspectionNet,
    cpu_threads,
    export_onnx,
    predict_proba,
    train_inspection_model,
)
from fedge.students.inspection import (
    StudentSettings,
    distill_student,
    generated_proxy,
    publish_student,
)

pytestmark = pytest.mark.integration

EDGE = "st-01"
IMAGES = 8


def _train_teacher(path: Path) -> InspectionNet:
    """A quickly trained teacher: enough for a student to have something to imitate."""
    images, labels = make_defect_images(400, seed=20)
    with cpu_threads(1):
        teacher = train_inspection_model(images, labels, epochs=4, seed=0, device="cpu")
    export_onnx(teacher, path)
    return teacher


def _deploy(fh: FleetHome, version: int) -> None:
    with fh.fleet() as fleet:
        deployment = fleet.deploy("inspect", version, [EDGE])
    wait_until(
        lambda: fh.edge_row(EDGE),
        40,
        f"{EDGE} to report inspect:{version} active",
        expect=lambda r: (
            r.get("deploy_id") == deployment
            and r.get("deploy_stage") == "active"
            and r.get("serving") == f"inspect:{version}"
        ),
    )


def _score(fh: FleetHome, images: np.ndarray, prefix: str) -> dict[str, dict[str, object]]:
    """Drop ``images`` into the agent's inbox; return the manager's predictions by file name."""
    inbox = fh.inbox(EDGE)
    staged = write_png_dir(images, inbox.parent / f".staging-{prefix}", prefix=prefix)
    inbox.mkdir(parents=True, exist_ok=True)
    for path in staged:
        os.replace(path, inbox / path.name)
    sources = [f"file:{path.name}" for path in staged]
    rows = wait_until(
        lambda: fh.db.query(
            f"SELECT * FROM predictions WHERE source IN ({','.join('?' * len(sources))})",
            tuple(sources),
        ),
        30,
        f"{len(sources)} predictions of {prefix} at the manager",
        expect=lambda found: len(found) == len(sources),
    )
    return {str(row["source"]).removeprefix("file:"): row for row in rows}


def test_a_distilled_student_is_deployed_and_serves_with_its_version(
    tmp_path: Path, processes: Processes
) -> None:
    fh = make_fleet_home(tmp_path, edges=(EDGE,))
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    teacher = _train_teacher(tmp_path / "teacher.onnx")
    with fh.fleet() as fleet:
        teacher_manifest = fleet.registry.publish(
            tmp_path / "teacher.onnx", name="inspect", version=1, classes=CLASSES,
            positive_classes=("scratch",),
        ).manifest  # fmt: skip

    processes.pidfiles.append(fh.home.root / "broker" / "mosquitto.pid")
    try:
        processes.start("broker", "manager", "broker")
        wait_until(lambda: port_open(fh.settings.broker_port), 15, "the managed broker to listen")
        ready = tmp_path / "serve.ready"
        processes.start("serve", "manager", "serve", "--ready-file", str(ready))
        agent = processes.start(EDGE, "agent", "run", "--config", str(fh.agents[EDGE]))
        wait_until(ready.exists, 20, "manager serve to be ready")
        wait_until(lambda: fh.edge_row(EDGE).get("state") == "online", 30, f"{EDGE} online")

        # -- the teacher serves first
        _deploy(fh, 1)
        images, _ = make_defect_images(2 * IMAGES, seed=21)
        before = _score(fh, images[:IMAGES], "before")
        assert {row["model"] for row in before.values()} == {"inspect:1"}

        # -- distil on unlabeled images, publish as the next version, deploy
        proxy = generated_proxy(300, seed=22)
        student, report = distill_student(
            teacher, proxy, make_defect_images(200, seed=23), tmp_path / "student.onnx",
            teacher_ref=teacher_manifest.ref, settings=StudentSettings(epochs=4),
        )  # fmt: skip
        assert report.compression >= 4.0
        with fh.fleet() as fleet:
            published = publish_student(fleet.registry, report, teacher_manifest)
        assert published.manifest.ref == "inspect:2"
        assert published.manifest.lineage.run_id == "inspect:1"
        _deploy(fh, 2)

        # -- what the station scores now is the student's, and says so
        after = _score(fh, images[IMAGES:], "after")
        student_probs = predict_proba(student, images[IMAGES:])
        for index in range(IMAGES):
            row = after[f"after_{index:05d}.png"]
            assert row["model"] == "inspect:2"
            scores = json.loads(str(row["scores"]))
            assert set(scores) == set(CLASSES)
            for class_index, name in enumerate(CLASSES):
                assert scores[name] == pytest.approx(student_probs[index, class_index], abs=1e-4)
            expected = "reject" if scores["scratch"] >= row["threshold"] else "accept"
            assert row["decision"] == expected
        assert fh.edge_row(EDGE)["serving"] == "inspect:2"
        models = fh.db.query("SELECT model, count(*) AS n FROM predictions GROUP BY model")
        assert models == [{"model": "inspect:1", "n": IMAGES}, {"model": "inspect:2", "n": IMAGES}]
        assert agent.running(), agent.output()
    finally:
        processes.close()
        fh.close()

"""The compact inspection student: distillation on unlabeled images, ONNX on the edge path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from fedge.cli.common import open_fleet
from fedge.cli.main import app
from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.edge_agent.inference import runtime
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.registry.versions import Registry
from fedge.edge_manager.store import Store
from fedge.models import digits
from fedge.models.distill import ProxyError, check_proxy, distill, export_student_onnx
from fedge.models.inspection import (
    INPUT_NAME,
    OUTPUT_NAME,
    InspectionNet,
    cpu_threads,
    export_onnx,
    images_to_tensor,
    predict_proba,
    train_inspection_model,
)
from fedge.students.inspection import (
    IMAGE_SHAPE,
    OnnxTeacher,
    ProxySet,
    StudentReport,
    StudentSettings,
    TeacherModelError,
    distill_student,
    generated_proxy,
    make_student,
    publish_student,
)

Images = npt.NDArray[np.uint8]
Labels = npt.NDArray[np.int64]

# A small fixed problem, about 25 s on one busy core: the teacher sees 600 labelled
# images, the student 2,000 other, unlabeled ones (on 800 it ended 6 points below).
SETTINGS = StudentSettings(width=4, epochs=12, batch_size=64, lr=1e-2, temperature=2.0)


@dataclass(frozen=True)
class Problem:
    teacher: InspectionNet
    proxy: ProxySet
    held_out: tuple[Images, Labels]


@pytest.fixture(scope="module")
def problem() -> Problem:
    images, labels = make_defect_images(600, seed=10)
    with cpu_threads(1):
        teacher = train_inspection_model(images, labels, epochs=8, seed=0, device="cpu")
    return Problem(teacher, generated_proxy(2000, seed=11), make_defect_images(400, seed=100))


@pytest.fixture(scope="module")
def distilled(
    problem: Problem, tmp_path_factory: pytest.TempPathFactory
) -> tuple[InspectionNet, StudentReport]:
    out = tmp_path_factory.mktemp("student") / "student.onnx"
    return distill_student(
        problem.teacher, problem.proxy, problem.held_out, out, teacher_ref="inspect:1",
        settings=SETTINGS, seed=0,
    )  # fmt: skip


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _registry(root: Path) -> Registry:
    home = ManagerHome(root / "home")
    home.init(ManagerSettings("student"))
    return Registry(Store(home.db_path), home.artifacts, home.signing_key())


# ---------------------------------------------------------------- distillation works


@pytest.mark.slow
def test_distillation_makes_a_compact_student_close_to_the_teacher(
    problem: Problem, distilled: tuple[InspectionNet, StudentReport]
) -> None:
    student, report = distilled
    images, labels = problem.held_out
    assert report.teacher == "inspect:1" and report.width == 4
    assert report.teacher_params == sum(p.numel() for p in problem.teacher.parameters())
    assert report.student_params == sum(p.numel() for p in student.parameters())
    assert report.compression >= 4.0, report
    assert report.teacher_accuracy >= 0.85, report
    # The un-distilled student (same seed, random init) is a coin toss; distillation,
    # without a single label, brings it near the teacher.
    assert report.student_init_accuracy <= 0.65, report
    assert report.student_accuracy >= report.student_init_accuracy + 0.25, report
    assert report.student_accuracy >= report.teacher_accuracy - 0.03, report
    assert report.last_epoch_loss < 0.3 * report.first_epoch_loss, report
    assert report.proxy_samples == 2000 and report.held_out_samples == len(labels)
    assert report.data == "2000 unlabeled generated surfaces (fedge.datasets.defects seed 11)"
    assert report.temperature == 2.0
    assert "inspect:1" in report.note and "T=2" in report.note
    agreement = np.mean(
        predict_proba(student, images).argmax(1) == predict_proba(problem.teacher, images).argmax(1)
    )
    assert agreement >= 0.9, agreement
    assert not student.training


def test_student_distillation_is_deterministic_for_a_seed(problem: Problem, tmp_path: Path) -> None:
    proxy = ProxySet(problem.proxy.images[:96], "a slice")
    settings = StudentSettings(width=4, epochs=2, batch_size=32)

    def run(seed: int, name: str) -> tuple[InspectionNet, StudentReport]:
        return distill_student(problem.teacher, proxy, problem.held_out, tmp_path / name,
                               teacher_ref="inspect:1", settings=settings, seed=seed)  # fmt: skip

    (first, first_report), (second, second_report) = run(5, "a.onnx"), run(5, "b.onnx")
    assert all(torch.equal(a, b) for a, b in zip(_weights(first), _weights(second), strict=True))
    assert first_report == second_report  # the ONNX path is not compared
    other, _ = run(6, "c.onnx")
    assert not all(torch.equal(a, b) for a, b in zip(_weights(first), _weights(other), strict=True))


# ---------------------------------------------------------------- ONNX on the edge path


@pytest.mark.slow
def test_published_student_runs_in_the_agent_runtime_with_torch_decisions(
    problem: Problem, distilled: tuple[InspectionNet, StudentReport], tmp_path: Path
) -> None:
    student, report = distilled
    assert report.export_max_abs_diff <= 1e-4
    registry = _registry(tmp_path)
    export_onnx(problem.teacher, tmp_path / "teacher.onnx")
    teacher = registry.publish(
        tmp_path / "teacher.onnx", name="inspect", version=1, classes=CLASSES,
        positive_classes=("scratch",),
    ).manifest  # fmt: skip

    published = publish_student(registry, report, teacher)
    manifest = published.manifest
    assert manifest.ref == "inspect:2"  # the next version of the teacher's name
    assert manifest.classes == CLASSES and manifest.positive_classes == ("scratch",)
    assert [(t.name, t.dtype) for t in manifest.inputs] == [(INPUT_NAME, "float32")]
    assert [(t.name, t.dtype) for t in manifest.outputs] == [(OUTPUT_NAME, "float32")]
    assert manifest.inputs[0].shape == teacher.inputs[0].shape  # same edge contract
    assert manifest.lineage.parent_version == 1
    assert manifest.lineage.run_id == "inspect:1"
    assert manifest.lineage.data == problem.proxy.data
    assert manifest.lineage.note == report.note

    loaded = runtime.load(published.path, manifest)
    runtime.smoke_test(loaded)
    images = images_to_tensor(problem.held_out[0]).numpy()
    for batch in (images[:1], images):  # the batch axis is dynamic
        probs = loaded.run(np.ascontiguousarray(batch))
        assert probs.shape == (len(batch), 2)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
        with torch.no_grad():
            expected = torch.softmax(student(torch.from_numpy(batch)), dim=1).numpy()
        np.testing.assert_allclose(probs, expected, atol=1e-4)
        np.testing.assert_array_equal(probs.argmax(axis=1), expected.argmax(axis=1))


@pytest.mark.slow
def test_publish_refuses_a_report_of_another_teacher(
    distilled: tuple[InspectionNet, StudentReport], problem: Problem, tmp_path: Path
) -> None:
    _, report = distilled
    registry = _registry(tmp_path)
    export_onnx(problem.teacher, tmp_path / "teacher.onnx")
    for version in (1, 2):
        registry.publish(tmp_path / "teacher.onnx", name="inspect", version=version,
                         classes=CLASSES)  # fmt: skip
    with pytest.raises(ValueError, match="distilled from inspect:1, not inspect:2"):
        publish_student(registry, report, registry.get("inspect", 2).manifest)
    assert registry.latest_version("inspect") == 2


# ---------------------------------------------------------------- bad proxy sets


class _CountingTeacher(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        logits: torch.Tensor = self.net(x)
        return logits


BAD_PROXIES = [
    (np.zeros((0, 1, 32, 32), dtype=np.float32), "empty"),
    (np.zeros((10, 32, 32), dtype=np.float32), "4-D"),
    (np.zeros((10, 3, 32, 32), dtype=np.float32), r"samples have shape \(3, 32, 32\)"),
    (np.zeros((10, 1, 16, 16), dtype=np.float32), r"the models take \(1, 32, 32\)"),
    (np.zeros((10, 1, 32, 32), dtype=np.uint8), "dtype uint8; scale uint8 images by 1/255"),
    (np.full((10, 1, 32, 32), np.inf, dtype=np.float32), "NaN or infinite"),
    ([[[[0.5] * 32] * 32]], "numpy array"),
]


@pytest.mark.parametrize(("images", "message"), BAD_PROXIES)
def test_a_bad_image_proxy_set_fails_before_any_training(
    images: object, message: str, problem: Problem, tmp_path: Path
) -> None:
    teacher = _CountingTeacher(problem.teacher)
    onnx_path = tmp_path / "student.onnx"
    with pytest.raises(ProxyError, match=message):
        distill_student(teacher, ProxySet(images, "bad"), problem.held_out, onnx_path,  # type: ignore[arg-type]
                        teacher_ref="inspect:1", settings=SETTINGS)  # fmt: skip
    assert teacher.calls == 0  # the teacher was never asked
    assert not onnx_path.exists()

    student = make_student(seed=0)
    before = _weights(student)
    with pytest.raises(ProxyError, match=message):
        distill(teacher, student, images, epochs=2, input_shape=IMAGE_SHAPE)  # type: ignore[arg-type]
    assert teacher.calls == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(student), strict=True))
    with pytest.raises(ProxyError, match=message):
        check_proxy(images, IMAGE_SHAPE)


def test_generated_proxy_is_float_images_without_labels() -> None:
    proxy = generated_proxy(16, seed=4)
    check_proxy(proxy.images, IMAGE_SHAPE)
    assert proxy.images.dtype == np.float32 and proxy.images.shape == (16, *IMAGE_SHAPE)
    assert float(proxy.images.min()) >= 0.0 and float(proxy.images.max()) <= 1.0
    raw, _ = make_defect_images(16, seed=4)
    np.testing.assert_array_equal(proxy.images[:, 0], raw.astype(np.float32) / 255.0)


def test_student_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="width >= 1"):
        StudentSettings(width=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        StudentSettings(temperature=0.0)
    with pytest.raises(ValueError, match="lr must be > 0"):
        StudentSettings(lr=float("nan"))


# ---------------------------------------------------------------- a published teacher and the CLI


def test_a_published_teacher_gives_the_torch_teachers_soft_targets(
    problem: Problem, tmp_path: Path
) -> None:
    export_onnx(problem.teacher, tmp_path / "teacher.onnx")
    published = OnnxTeacher(tmp_path / "teacher.onnx")
    assert published.parameters == sum(p.numel() for p in problem.teacher.parameters())
    x = torch.from_numpy(problem.proxy.images[:64])
    with torch.no_grad():
        logits = problem.teacher(x)
    for temperature in (1.0, 2.0, 4.0):
        np.testing.assert_allclose(
            torch.softmax(published(x) / temperature, dim=1).numpy(),
            torch.softmax(logits / temperature, dim=1).numpy(),
            atol=1e-4,
        )

    digits_student = tmp_path / "digits.onnx"
    export_student_onnx(digits.make_model("mlp-small", seed=0), digits_student)
    with pytest.raises(TeacherModelError, match="an inspection model has"):
        OnnxTeacher(digits_student)


@pytest.mark.slow
def test_cli_distils_a_published_teacher_into_the_next_version(
    problem: Problem, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    ManagerHome(home).init(ManagerSettings("cli"))
    export_onnx(problem.teacher, tmp_path / "teacher.onnx")
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["model", "publish", str(tmp_path / "teacher.onnx"), "--name", "inspect", "--version",
         "1", "--classes", "clean,scratch", "--positive", "scratch", "--home", str(home)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output

    out = tmp_path / "student.onnx"
    args = ["model", "distill", "--task", "inspection", "--teacher", "inspect:1", "--out",
            str(out), "--proxy-images", "300", "--home", str(home)]  # fmt: skip
    result = runner.invoke(app, [*args, "--publish"])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # rich wraps lines at the terminal width
    assert "teacher inspect:1: 14114 parameters" in output
    assert "938 parameters (15.0x fewer)" in output
    assert "300 unlabeled generated surfaces (fedge.datasets.defects seed 1000) (T=2)" in output
    assert "published inspect:2" in output
    _, fleet = open_fleet(home)
    lineage = fleet.registry.get("inspect", 2).manifest.lineage
    assert (lineage.parent_version, lineage.run_id) == (1, "inspect:1")
    assert lineage.data == "300 unlabeled generated surfaces (fedge.datasets.defects seed 1000)"
    assert lineage.note.startswith("distilled from inspect:1 (T=2, width 4")

    for teacher, message in (("inspect:7", "inspect:7"), ("teacher.pt", "NAME:VERSION")):
        args[5] = teacher
        result = runner.invoke(app, args)
        assert result.exit_code == 1, result.output
        assert message in result.output
    result = runner.invoke(app, [*args[:5], "inspect:1", *args[6:], "--temperature", "0"])
    assert result.exit_code != 0 and "must be > 0" in result.output

"""The cloud -> edge flow around :mod:`fedge.models.distill`: teacher, student, registry.

1. A **teacher** is a finished federated job's final model (:func:`load_job_teacher`), a
   saved torch state (``.pt``, :func:`save_teacher`), or trained here on a scenario's
   pooled party data (:func:`train_teacher`, a centrally trained stand-in for a
   federated teacher).
2. The **student** (``mlp-small`` by default) is distilled on the scenario's unlabeled
   proxy split (:func:`distill_student`); the test split only measures both models.
3. The student is exported to ONNX (the edge contract of
   :func:`fedge.models.distill.export_student_onnx`) and can be published to the edge
   manager's registry with its lineage (:func:`publish_student`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedge.datasets.tables import Partitions, Source, Split
from fedge.edge_manager.registry.versions import PublishedModel, Registry
from fedge.models import digits
from fedge.models.distill import ExportCheck, check_proxy, distill, export_student_onnx
from fedge.party import trainer
from fedge.protocols.manifest import Lineage
from fedge.students.errors import StudentError

TEACHER_ARCH = "mlp-large"
STUDENT_ARCH = "mlp-small"

# Central teacher training: SGD on the pooled party data (~1,165 samples on tifl-digits).
TEACHER_EPOCHS = 40
TEACHER_LR = 0.1
TEACHER_BATCH = 32

# Distillation defaults: T and lr chosen on tifl-digits seed 0 from T in {1, 2, 4, 8} x
# lr in {3e-3, 1e-2}, 300 epochs on the plain proxy split (BENCHMARKS.md section 7);
# Hinton's note: small students like T = 2.5-4. Over the shift-augmented transfer set
# (5x the samples) 100 epochs are about the same number of optimizer steps.
DISTILL_EPOCHS = 100  # on the shift-augmented transfer set (the default)
DISTILL_EPOCHS_PLAIN = 300  # on the proxy split alone (augment=False)
DISTILL_LR = 1e-2
DISTILL_BATCH = 32
TEMPERATURE = 4.0

_TEACHER_FORMAT = "fedge-teacher/1"


class TeacherError(StudentError):
    """A teacher file cannot be read, or a teacher spec is neither a file nor an arch."""


@dataclass(frozen=True)
class Teacher:
    model: nn.Module
    arch: str
    description: str
    """Where it came from, e.g. ``mlp-large trained on pooled parties of tifl-digits seed 0``."""


@dataclass(frozen=True)
class StudentReport:
    teacher: str
    teacher_arch: str
    student_arch: str
    teacher_params: int
    student_params: int
    teacher_accuracy: float
    student_accuracy: float
    student_init_accuracy: float
    """The student before distillation (random init): what distillation added."""
    proxy_samples: int
    temperature: float
    data: str
    """``proxy split of <scenario> seed <s>``: the registry lineage's data field."""
    first_epoch_loss: float
    last_epoch_loss: float

    @property
    def compression(self) -> float:
        return self.teacher_params / self.student_params

    @property
    def note(self) -> str:
        return f"distilled from {self.teacher} (T={self.temperature:g})"


SHIFTS = ((0, 1), (0, -1), (1, 0), (-1, 0))
"""One-pixel shifts (rows, columns) of an 8x8 digit: the augmentation of the proxy set."""


def _shift(images: npt.NDArray[np.float32], rows: int, cols: int) -> npt.NDArray[np.float32]:
    """Move every 8x8 image by (rows, cols) pixels; what moves in from outside is blank."""
    out = np.zeros_like(images)
    h, w = images.shape[1:]
    out[:, max(rows, 0) : h + min(rows, 0), max(cols, 0) : w + min(cols, 0)] = images[
        :, max(-rows, 0) : h + min(-rows, 0), max(-cols, 0) : w + min(-cols, 0)
    ]
    return out


def shifted_proxy(proxy_X: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """The proxy set and its one-pixel shifts of the 8x8 digits: 5x the transfer samples.

    The transfer set is what limits a student distilled on 144 unlabeled samples: the
    teacher's answers on shifted digits (still digits: a shift by one pixel is the classic
    augmentation for handwriting, Simard et al., ICDAR 2003) carry more of what it knows.
    Beyer et al. (CVPR 2022) found the same at scale: the teacher must see the student's
    augmented inputs ("consistent" teaching). Labels stay unused; the pixel row or column
    that a shift pushes out is dropped and the one it opens is blank (0), as on the scanner.
    """
    images = proxy_X.reshape(-1, 8, 8).astype(np.float32, copy=False)
    views = [proxy_X.astype(np.float32, copy=False)]
    views += [_shift(images, rows, cols).reshape(len(proxy_X), -1) for rows, cols in SHIFTS]
    return np.concatenate(views)


def pooled_party_data(partitions: Partitions) -> Split:
    """Every party's training split, concatenated (what a central teacher may train on)."""
    xs = [x for x, _ in partitions.parties]
    ys = [y for _, y in partitions.parties]
    return np.concatenate(xs), np.concatenate(ys)


def train_teacher(
    source: Source,
    arch: str = TEACHER_ARCH,
    *,
    epochs: int = TEACHER_EPOCHS,
) -> Teacher:
    """Train ``arch`` centrally on the source's pooled party data (CPU, deterministic)."""
    seed = source.seed
    X, y = pooled_party_data(source.partitions)
    model = digits.make_model(arch, seed)
    # The parties' own trainer, as plain SGD without a time cap (left in eval mode).
    settings = trainer.TrainSettings(
        lr=TEACHER_LR, epochs=epochs, batch_size=TEACHER_BATCH, max_seconds=None,
        threads=None, seed=seed, optimizer="sgd",
    )  # fmt: skip
    trainer.train(model, trainer.Examples(X, y), settings, on=torch.device("cpu"))
    description = f"{arch} trained on pooled parties of {source.name}"
    return Teacher(model, arch, description)


def save_teacher(teacher: Teacher, path: Path) -> None:
    """Write the teacher's arch, description and ``state_dict`` to ``path`` (torch.save)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "format": _TEACHER_FORMAT,
            "arch": teacher.arch,
            "description": teacher.description,
            "state_dict": teacher.model.state_dict(),
        },
        path,
    )


def load_teacher(path: Path) -> Teacher:
    """Read a file written by :func:`save_teacher` (weights only: no code is unpickled)."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TeacherError(f"teacher file {path} does not exist") from None
    except Exception as exc:  # torch raises many types for a bad file
        raise TeacherError(f"cannot read teacher file {path}: {exc}") from None
    if not isinstance(blob, dict) or blob.get("format") != _TEACHER_FORMAT:
        raise TeacherError(
            f"{path} is not a fedge teacher file; write one with `fedge model train-teacher`"
        )
    arch, description = blob["arch"], blob["description"]
    if not isinstance(arch, str) or not isinstance(description, str):
        raise TeacherError(f"{path}: arch and description must be strings")
    model = digits.make_model(arch)
    try:
        model.load_state_dict(blob["state_dict"], strict=True)
    except (RuntimeError, KeyError) as exc:
        raise TeacherError(f"{path}: the weights do not fit a {arch} model: {exc}") from None
    model.eval()
    return Teacher(model, arch, f"{description} ({path.name})")


def load_job_teacher(job_dir: Path) -> Teacher:
    """The final model of a completed federated job (``fedge aggregator run``) as a teacher.

    The job keeps its final model's arrays; the architecture is the one they fit.
    """
    from fedge.aggregator.jobs.checkpoint import CheckpointError, load_arrays
    from fedge.aggregator.jobs.directory import FINAL_MODEL

    path = job_dir / FINAL_MODEL
    if not path.is_file():
        raise TeacherError(
            f"{job_dir} holds no finished job ({FINAL_MODEL} is missing): run or resume it "
            "with `fedge aggregator` first"
        )
    try:
        arrays = load_arrays(path)
    except CheckpointError as exc:
        raise TeacherError(f"cannot read the job's final model {path}: {exc}") from None
    state = {key: torch.from_numpy(value) for key, value in arrays.items()}
    for arch in digits.ARCHITECTURES:
        model = digits.make_model(arch)
        try:
            model.load_state_dict(state, strict=True)
        except (RuntimeError, KeyError):
            continue
        model.eval()
        return Teacher(model, arch, f"{arch}: final model of the federated job in {job_dir}")
    known = ", ".join(sorted(digits.ARCHITECTURES))
    raise TeacherError(f"{path} fits none of the known architectures ({known})")


def resolve_teacher(spec: str, source: Source) -> Teacher:
    """``spec`` is a finished job's directory (a federated teacher), a ``.pt`` file from
    :func:`save_teacher`, or an architecture to train centrally here."""
    if spec in digits.ARCHITECTURES:
        return train_teacher(source, spec)
    path = Path(spec)
    if path.is_dir():
        return load_job_teacher(path)
    if path.suffix == ".pt" or path.exists():
        return load_teacher(path)
    known = ", ".join(sorted(digits.ARCHITECTURES))
    raise TeacherError(
        f"--teacher {spec!r} is neither a job directory, a teacher file (.pt) nor an "
        f"architecture ({known})"
    )


def distill_student(
    teacher: Teacher,
    source: Source,
    arch: str = STUDENT_ARCH,
    *,
    epochs: int | None = None,
    lr: float = DISTILL_LR,
    temperature: float = TEMPERATURE,
    augment: bool = True,
) -> tuple[nn.Module, StudentReport]:
    """Distil ``teacher`` into a fresh ``arch`` on the source's proxy split; measure both.

    With ``augment`` the transfer set is the proxy split plus its one-pixel shifts
    (:func:`shifted_proxy`). ``epochs`` defaults to :data:`DISTILL_EPOCHS` with
    ``augment``, :data:`DISTILL_EPOCHS_PLAIN` without.
    """
    if epochs is None:
        epochs = DISTILL_EPOCHS if augment else DISTILL_EPOCHS_PLAIN
    from fedge.models.distill import DistillStats

    partitions, seed = source.partitions, source.seed
    test_X, test_y = partitions.test
    student = digits.make_model(arch, seed)
    init_accuracy = digits.accuracy(student, test_X, test_y, device="cpu")
    stats: list[DistillStats] = []
    check_proxy(partitions.proxy_X)  # before it is augmented: name the scenario's own flaw
    transfer = shifted_proxy(partitions.proxy_X) if augment else partitions.proxy_X
    distill(
        teacher.model,
        student,
        transfer,
        epochs=epochs,
        lr=lr,
        batch_size=DISTILL_BATCH,
        temperature=temperature,
        seed=seed,
        stats=stats,
    )
    report = StudentReport(
        teacher=teacher.description,
        teacher_arch=teacher.arch,
        student_arch=arch,
        teacher_params=digits.count_parameters(teacher.model),
        student_params=digits.count_parameters(student),
        teacher_accuracy=digits.accuracy(teacher.model, test_X, test_y, device="cpu"),
        student_accuracy=digits.accuracy(student, test_X, test_y, device="cpu"),
        student_init_accuracy=init_accuracy,
        proxy_samples=len(partitions.proxy_X),
        temperature=temperature,
        data=f"proxy split of {source.name}" + (" with one-pixel shifts" if augment else ""),
        first_epoch_loss=stats[0].first_epoch_loss,
        last_epoch_loss=stats[0].last_epoch_loss,
    )
    return student, report


def export_student(student: nn.Module, path: Path, source: Source) -> ExportCheck:
    """Export to ONNX and verify against torch on the source's proxy split."""
    return export_student_onnx(student, path, verify_X=source.partitions.proxy_X)


def publish_student(
    registry: Registry, onnx_path: Path, *, name: str, version: int, report: StudentReport
) -> PublishedModel:
    """Publish the exported student with its lineage (teacher, proxy data, temperature)."""
    lineage = Lineage(
        parent_version=None, run_id=report.teacher, data=report.data, note=report.note
    )
    return registry.publish(onnx_path, name=name, version=version, lineage=lineage)

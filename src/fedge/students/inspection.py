"""The compact edge student of the inspection CNN: distil ``inspect:N`` into ``inspect:N+1``.

KnowledgeNet's cloud -> edge transfer on the fleet's own task: the cloud keeps a larger,
well-trained inspection CNN (the teacher, e.g. ``inspect:1``); the stations get a much
smaller one that learnt to imitate it.

* The **student** is :class:`~fedge.models.inspection.InspectionNet` at a quarter of the
  teacher's width (``width=4``: 938 parameters against 14,114, about 15x fewer), so the
  edge's input and output contract do not change at all.
* It learns on an **unlabeled proxy set** of generated surfaces (:func:`generated_proxy`
  drops the labels; nothing downstream could read them) from the teacher's softened
  probabilities: Hinton et al. 2015's ``T^2 * KL`` loss, in the loop that the digits
  students share (:func:`fedge.models.distill.distill`).
* The teacher is a torch model, or a published ONNX model read back from the registry
  (:class:`OnnxTeacher`), so ``fedge model distill --task inspection --teacher inspect:1``
  needs nothing but the manager's home.
* It is exported with the same ONNX contract as the teacher (``image`` float32
  ``[batch, 1, 32, 32]`` -> ``probs`` ``[batch, 2]``, dynamic batch; checked against torch
  with ONNX Runtime on the proxy images) and published as the next version of the
  teacher's name with a lineage naming the teacher, the proxy data and the temperature
  (:func:`publish_student`), so an agent serving ``inspect:1`` swaps to it like any update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedge.datasets.defects import make_defect_images
from fedge.edge_manager.registry.versions import PublishedModel, Registry
from fedge.models.digits import count_parameters
from fedge.models.distill import DistillStats, check_proxy, distill
from fedge.models.inspection import (
    IMAGE_SIZE,
    INPUT_NAME,
    OUTPUT_NAME,
    InspectionNet,
    cpu_threads,
    evaluate,
    export_onnx,
    images_to_tensor,
    new_model,
)
from fedge.protocols.manifest import Lineage, ModelManifest
from fedge.students.errors import StudentError

IMAGE_SHAPE: tuple[int, int, int] = (1, IMAGE_SIZE, IMAGE_SIZE)
"""One proxy sample: a grayscale 32x32 image, as the edge feeds the model."""
PROXY_IMAGES = 6000
"""Unlabeled generated images to distil on (see :class:`StudentSettings` for why)."""


class TeacherModelError(StudentError):
    """A model file cannot serve as the inspection teacher (unreadable, or not image -> probs)."""


@dataclass(frozen=True)
class StudentSettings:
    """How the student is built and distilled.

    The defaults were chosen on the demo's teacher (``inspect:1``: 3,000 images, 8
    epochs, seed 0; 97.1 % on 2,000 held-out images) from width in {4, 5, 6, 8} x T in
    {2, 4} x proxy size in {3,000, 4,000, 6,000} x batch in {64, 128} (constant and
    cosine learning rates). Width 4 on 6,000 proxy images for 20 epochs stayed 0.4-1.0
    points below the teacher over two seeds, at 15x fewer parameters and about 30 s on
    one core. ``T = 2`` beat ``T = 4`` (likely because, with two classes, a hotter
    softmax pulls the teacher's outputs towards 0.5); Hinton et al. 2015 also found
    intermediate temperatures best for their smallest MNIST students. The proxy size is
    the caller's (:func:`generated_proxy`): on 3,000 images the same student ended about
    2 points below the teacher.
    """

    width: int = 4
    epochs: int = 20
    lr: float = 1e-2
    batch_size: int = 64
    temperature: float = 2.0

    def __post_init__(self) -> None:
        if self.width < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError(
                "a student needs width >= 1, epochs >= 1 and batch_size >= 1; got "
                f"width={self.width}, epochs={self.epochs}, batch_size={self.batch_size}"
            )
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (np.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True, eq=False)
class ProxySet:
    """Unlabeled distillation inputs: float32 ``[n, 1, 32, 32]`` in [0, 1], and their origin."""

    images: npt.NDArray[np.floating]
    data: str
    """Where the images came from; it becomes the registry lineage's ``data`` field."""


def generated_proxy(n: int, seed: int) -> ProxySet:
    """``n`` generated surfaces (:func:`fedge.datasets.defects.make_defect_images`), labels dropped.

    Use a seed that neither the teacher's training set nor the held-out set uses.
    """
    images, _ = make_defect_images(n, seed=seed)  # the labels stop here: no one reads them
    return ProxySet(
        images_to_tensor(images).numpy(),
        f"{n} unlabeled generated surfaces (fedge.datasets.defects seed {seed})",
    )


@dataclass(frozen=True)
class StudentReport:
    """What distillation produced: sizes, held-out accuracies, losses and the export check."""

    teacher: str
    """The teacher's registry reference, e.g. ``inspect:1``."""
    width: int
    teacher_params: int
    student_params: int
    teacher_accuracy: float
    student_accuracy: float
    student_init_accuracy: float
    """The student before distillation (random init): what distillation added."""
    held_out_samples: int
    proxy_samples: int
    data: str
    temperature: float
    first_epoch_loss: float
    last_epoch_loss: float
    export_max_abs_diff: float
    """Max |ONNX Runtime - torch| of the exported probabilities over the proxy images."""
    onnx_path: Path = field(compare=False)

    @property
    def compression(self) -> float:
        return self.teacher_params / self.student_params

    @property
    def note(self) -> str:
        return (
            f"distilled from {self.teacher} (T={self.temperature:g}, width {self.width}, "
            f"{self.compression:.1f}x fewer parameters)"
        )


class OnnxTeacher:
    """A published inspection model (ONNX, ``image`` -> ``probs``) as a frozen teacher.

    The registry keeps only the exported graph, whose output is softmax probabilities.
    Their logarithm serves as the teacher's logits: ``log p = z - logsumexp(z)`` differs
    from the logits ``z`` by one constant per sample, and softmax ignores such a shift, so
    Hinton et al. 2015's soft targets ``softmax(z / T)`` come out the same at every ``T``.
    """

    # Probabilities that underflowed to 0 get log 1e-30 (about -69): still "impossible"
    # after division by any sensible T, and no -inf reaches the loss.
    _FLOOR = 1e-30

    def __init__(self, path: Path) -> None:
        import onnx  # local: only needed to count the teacher's weights
        import onnxruntime as ort

        try:
            self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            graph = onnx.load(str(path)).graph
        except Exception as exc:  # ORT and onnx raise many unrelated types
            raise TeacherModelError(f"cannot load teacher model {path}: {exc}") from exc
        names = (
            [i.name for i in self.session.get_inputs()],
            [o.name for o in self.session.get_outputs()],
        )
        if names != ([INPUT_NAME], [OUTPUT_NAME]):
            raise TeacherModelError(
                f"teacher model {path} has inputs/outputs {names}, an inspection model has "
                f"[{INPUT_NAME!r}] -> [{OUTPUT_NAME!r}]"
            )
        self.path = path
        self.parameters = sum(int(np.prod(tensor.dims)) for tensor in graph.initializer)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Log-probabilities ``[batch, classes]`` of float32 images ``[batch, 1, 32, 32]``."""
        batch = np.ascontiguousarray(images.detach().cpu().numpy(), dtype=np.float32)
        (probs,) = self.session.run([OUTPUT_NAME], {INPUT_NAME: batch})
        return torch.log(torch.from_numpy(np.asarray(probs)).clamp_min(self._FLOOR))


TeacherModel = nn.Module | OnnxTeacher


def _teacher_params(teacher: TeacherModel) -> int:
    return teacher.parameters if isinstance(teacher, OnnxTeacher) else count_parameters(teacher)


def _teacher_accuracy(
    teacher: TeacherModel, images: npt.NDArray[np.generic], labels: npt.NDArray[np.integer]
) -> float:
    if isinstance(teacher, nn.Module):
        return evaluate(teacher, images, labels)
    if len(labels) == 0:
        raise ValueError("cannot evaluate on an empty set")
    x_all = images_to_tensor(images)
    predicted = np.concatenate(
        [
            teacher(x_all[start : start + 256]).argmax(dim=1).numpy()
            for start in range(0, len(x_all), 256)
        ]
    )
    return float(np.mean(predicted == np.asarray(labels)))


def make_student(seed: int, width: int = StudentSettings.width) -> InspectionNet:
    """A fresh, seeded student: the inspection CNN at ``width`` channels in its first layer."""
    return new_model(seed, width=width)


def distill_student(
    teacher: TeacherModel,
    proxy: ProxySet,
    held_out: tuple[npt.NDArray[np.generic], npt.NDArray[np.integer]],
    onnx_path: Path,
    *,
    teacher_ref: str,
    settings: StudentSettings | None = None,
    seed: int = 0,
) -> tuple[InspectionNet, StudentReport]:
    """Distil ``teacher`` into a fresh student on ``proxy``, export it, measure both models.

    ``teacher`` is a trained torch model or a published one (:class:`OnnxTeacher`);
    ``teacher_ref`` names it (``inspect:1``) in the report and the lineage. The proxy set
    is checked before anything runs (:class:`fedge.models.distill.ProxyError` for an
    empty, mis-shaped, non-float or non-finite set). ``held_out`` (images, labels) only
    measures the two models. Training runs on the CPU on one thread and is
    deterministic for a seed. The ONNX file at ``onnx_path`` is verified against torch on
    every proxy image (:class:`fedge.models.inspection.ModelExportError` above 1e-4).
    """
    settings = settings or StudentSettings()
    check_proxy(proxy.images, IMAGE_SHAPE)
    held_out_images, held_out_labels = held_out
    student = make_student(seed, settings.width)
    stats: list[DistillStats] = []
    with cpu_threads(1):
        init_accuracy = evaluate(student, held_out_images, held_out_labels)
        distill(
            teacher,
            student,
            proxy.images,
            epochs=settings.epochs,
            lr=settings.lr,
            batch_size=settings.batch_size,
            temperature=settings.temperature,
            seed=seed,
            stats=stats,
            input_shape=IMAGE_SHAPE,
        )
        teacher_accuracy = _teacher_accuracy(teacher, held_out_images, held_out_labels)
        student_accuracy = evaluate(student, held_out_images, held_out_labels)
        export_diff = export_onnx(student, onnx_path, verify_images=proxy.images)
    report = StudentReport(
        teacher=teacher_ref,
        width=settings.width,
        teacher_params=_teacher_params(teacher),
        student_params=count_parameters(student),
        teacher_accuracy=teacher_accuracy,
        student_accuracy=student_accuracy,
        student_init_accuracy=init_accuracy,
        held_out_samples=len(held_out_labels),
        proxy_samples=len(proxy.images),
        data=proxy.data,
        temperature=settings.temperature,
        first_epoch_loss=stats[0].first_epoch_loss,
        last_epoch_loss=stats[0].last_epoch_loss,
        export_max_abs_diff=export_diff,
        onnx_path=onnx_path,
    )
    return student, report


def publish_student(
    registry: Registry,
    report: StudentReport,
    teacher: ModelManifest,
    *,
    version: int | None = None,
) -> PublishedModel:
    """Publish the exported student as the next version of the teacher's model name.

    Classes and defect classes are the teacher's (same contract, so thresholds pushed for
    the teacher keep their meaning); the lineage names the teacher as parent and run, the
    proxy data, and the temperature in its note. ``version`` defaults to the latest
    published version of the name plus one.
    """
    if report.teacher != teacher.ref:
        raise ValueError(f"the report was distilled from {report.teacher}, not {teacher.ref}")
    if version is None:
        version = (registry.latest_version(teacher.name) or 0) + 1
    lineage = Lineage(
        parent_version=teacher.version, run_id=teacher.ref, data=report.data, note=report.note
    )
    return registry.publish(
        report.onnx_path,
        name=teacher.name,
        version=version,
        classes=teacher.classes,
        positive_classes=teacher.positive_classes,
        # The student takes the teacher's images prepared the teacher's way: declared, so
        # an anomaly model built on the teacher's backbone can serve beside it (issue 28).
        preprocess=teacher.preprocess,
        lineage=lineage,
    )

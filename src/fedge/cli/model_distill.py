"""``fedge model train-teacher`` and ``fedge model distill``: small students from a teacher.

The student builders (:mod:`fedge.students`) and model families load torch: they are
imported inside the commands, so the rest of the CLI starts without it.
"""

import dataclasses
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from fedge.cli.common import DEFAULT_HOME, HomeOption, console, friendly_errors, open_fleet
from fedge.cli.model_publish import published_line
from fedge.datasets.defects import make_defect_images
from fedge.edge_manager.registry.versions import parse_ref
from fedge.sim.data import make_partitions
from fedge.sim.data import source as data_source
from fedge.sim.scenario import load_scenario


@friendly_errors
def train_teacher(
    arch: Annotated[str, typer.Option(help="Teacher architecture.")] = "mlp-large",
    scenario: Annotated[str, typer.Option(help="Scenario name or path.")] = "tifl-digits",
    seed: Annotated[int, typer.Option(help="Seed of the split and the model.")] = 0,
    out: Annotated[Path, typer.Option(help="Where to write the torch state.")] = Path("teacher.pt"),
) -> None:
    """Train a teacher centrally on the scenario's pooled party data; save it for distill.

    Example: fedge model train-teacher --arch mlp-large --scenario tifl-digits --out teacher.pt
    """
    from fedge.models import digits
    from fedge.students import edge as edge_student

    loaded = load_scenario(scenario)
    teacher = edge_student.train_teacher(data_source(loaded, seed), arch)
    edge_student.save_teacher(teacher, out)
    test_x, test_y = make_partitions(loaded, seed).test
    console.print(
        f"teacher {teacher.arch}: {digits.count_parameters(teacher.model)} parameters, "
        f"test accuracy {digits.accuracy(teacher.model, test_x, test_y, device='cpu'):.4f} "
        f"-> {out}"
    )


class Task(StrEnum):
    digits = "digits"
    inspection = "inspection"


@friendly_errors
def distill(
    teacher: Annotated[
        str,
        typer.Option(
            help="digits: a finished job's directory (fedge aggregator run: a federated "
            "teacher), a teacher .pt from train-teacher, or an arch to train first; "
            "inspection: a published model, e.g. inspect:1."
        ),
    ],
    task: Annotated[Task, typer.Option(help="Which model family to distil.")] = Task.digits,
    arch: Annotated[
        str | None, typer.Option(help="Student architecture (digits) [default: mlp-small].")
    ] = None,
    scenario: Annotated[
        str | None, typer.Option(help="Scenario name or path (digits) [default: tifl-digits].")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the split and the student.")] = 0,
    temperature: Annotated[
        float | None,
        typer.Option(help="Distillation temperature T [default: 4 digits, 2 inspection]."),
    ] = None,
    proxy_images: Annotated[
        int | None,
        typer.Option(help="Unlabeled generated images to distil on (inspection) [default: 6000]."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Where to write the student ONNX.")] = Path(
        "student.onnx"
    ),
    publish_to_registry: Annotated[
        bool, typer.Option("--publish", help="Publish the student to the registry.")
    ] = False,
    name: Annotated[
        str | None,
        typer.Option(help="Registry name (digits, with --publish) [default: digits-student]."),
    ] = None,
    version: Annotated[
        int | None,
        typer.Option(help="Registry version [default: the name's latest version + 1, or 1]."),
    ] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Distil a teacher into a small student on unlabeled proxy data.

    With --publish the student becomes the next version of its name (the teacher's name
    for inspection), unless --version says which.

    Example: fedge model distill --teacher mlp-large --arch mlp-small --out student.onnx
    --publish --name digits-student

    Example: fedge model distill --task inspection --teacher inspect:1 --publish
    """
    if temperature is not None and temperature <= 0:
        raise typer.BadParameter("must be > 0", param_hint="--temperature")
    # An option of the other task would be silently ignored: refuse it instead.
    if task is Task.inspection:
        for hint, value in (("--arch", arch), ("--scenario", scenario), ("--name", name)):
            if value is not None:
                raise typer.BadParameter("only for --task digits", param_hint=hint)
        _distill_inspection(
            teacher, seed, temperature, proxy_images, out,
            publish_to_registry, version, home,
        )  # fmt: skip
    else:
        if proxy_images is not None:
            raise typer.BadParameter("only for --task inspection", param_hint="--proxy-images")
        _distill_digits(
            teacher, arch or "mlp-small", scenario or "tifl-digits", seed, temperature, out,
            publish_to_registry, name or "digits-student", version, home,
        )  # fmt: skip


def _distill_digits(
    teacher: str,
    arch: str,
    scenario: str,
    seed: int,
    temperature: float | None,
    out: Path,
    publish_to_registry: bool,
    name: str,
    version: int | None,
    home: Path,
) -> None:
    from fedge.students import edge as edge_student

    # Open the registry first: a wrong --home fails before any training.
    fleet = open_fleet(home)[1] if publish_to_registry else None
    if fleet is not None and version is None:
        version = (fleet.registry.latest_version(name) or 0) + 1
    loaded = load_scenario(scenario)
    split = data_source(loaded, seed)
    resolved = edge_student.resolve_teacher(teacher, split)
    student, report = edge_student.distill_student(
        resolved, split, arch,
        temperature=edge_student.TEMPERATURE if temperature is None else temperature,
    )  # fmt: skip
    check = edge_student.export_student(student, out, split)
    console.print(
        f"teacher: {report.teacher}\n"
        f"  {report.teacher_arch}: {report.teacher_params} parameters, "
        f"test accuracy {report.teacher_accuracy:.4f}\n"
        f"student {report.student_arch}: {report.student_params} parameters "
        f"({report.compression:.1f}x fewer), test accuracy {report.student_accuracy:.4f} "
        f"(before distillation {report.student_init_accuracy:.4f})\n"
        f"distilled on {report.data} ({report.proxy_samples} unlabeled samples, "
        f"T={report.temperature:g})\n"
        f"exported {out}: ONNX Runtime vs torch max |diff| probs "
        f"{check.probs_max_abs_diff:.2g}, logits {check.logits_max_abs_diff:.2g}",
        highlight=False,
    )
    if fleet is not None and version is not None:
        published = edge_student.publish_student(
            fleet.registry, out, name=name, version=version, report=report
        )
        console.print(
            published_line(published.manifest), markup=False, highlight=False, soft_wrap=True
        )


# Generated-image seeds of the inspection student, offset from the demo's (1, 2, 3, 7, 8)
# so a student distilled here never sees the demo teacher's training images.
_PROXY_SEED_BASE, _HELD_OUT_SEED_BASE = 1000, 2000
_HELD_OUT_IMAGES = 2000


def _distill_inspection(
    teacher: str,
    seed: int,
    temperature: float | None,
    proxy_images: int | None,
    out: Path,
    publish_to_registry: bool,
    version: int | None,
    home: Path,
) -> None:
    from fedge.students import inspection as students

    if proxy_images is None:
        proxy_images = students.PROXY_IMAGES
    if proxy_images < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--proxy-images")
    # The teacher is a published model: the registry is read before any training.
    fleet = open_fleet(home)[1]
    published_teacher = fleet.registry.get(*parse_ref(teacher))
    teacher_manifest = published_teacher.manifest
    onnx_teacher = students.OnnxTeacher(published_teacher.path)
    settings = students.StudentSettings()
    if temperature is not None:
        settings = dataclasses.replace(settings, temperature=temperature)
    proxy = students.generated_proxy(proxy_images, _PROXY_SEED_BASE + seed)
    held_out = make_defect_images(_HELD_OUT_IMAGES, seed=_HELD_OUT_SEED_BASE + seed)
    _, report = students.distill_student(
        onnx_teacher, proxy, held_out, out, teacher_ref=teacher_manifest.ref,
        settings=settings, seed=seed,
    )  # fmt: skip
    console.print(
        f"teacher {report.teacher}: {report.teacher_params} parameters, held-out accuracy "
        f"{report.teacher_accuracy:.4f} ({report.held_out_samples} generated images)\n"
        f"student (width {report.width}): {report.student_params} parameters "
        f"({report.compression:.1f}x fewer), held-out accuracy {report.student_accuracy:.4f} "
        f"(before distillation {report.student_init_accuracy:.4f})\n"
        f"distilled on {report.data} (T={report.temperature:g}); loss "
        f"{report.first_epoch_loss:.3g} -> {report.last_epoch_loss:.3g}\n"
        f"exported {out}: ONNX Runtime vs torch max |diff| {report.export_max_abs_diff:.2g}",
        highlight=False,
    )
    if publish_to_registry:
        published = students.publish_student(
            fleet.registry, report, teacher_manifest, version=version
        )
        console.print(
            published_line(published.manifest), markup=False, highlight=False, soft_wrap=True
        )

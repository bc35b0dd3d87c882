"""``fedge model``: publish and list model versions."""

import dataclasses
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    fitted_table,
    friendly_errors,
    open_fleet,
    print_json,
    when,
)
from fedge.cli.gate import gate
from fedge.protocols.manifest import Lineage, ModelManifest, Thresholds

app = typer.Typer(help="The model registry.", no_args_is_help=True)
# The validation gate (cli/gate.py): `fedge model gate inspect:4`.
app.command("gate")(gate)


def _split(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


def _published_line(manifest: ModelManifest) -> str:
    """One plain line about a newly published version (no reprs: people read it)."""
    lineage = manifest.lineage
    parent = "-" if lineage.parent_version is None else f"{manifest.name}:{lineage.parent_version}"
    line = (
        f"published {manifest.ref} sha256={manifest.sha256[:12]}… size={manifest.size} "
        f"classes={','.join(manifest.classes)} parent={parent}"
    )
    return f"{line}; {lineage.note}" if lineage.note else line


@app.command()
@friendly_errors
def publish(
    path: Path,
    name: Annotated[str, typer.Option(help="Model name, e.g. inspect.")],
    version: Annotated[int, typer.Option(help="New version number.")],
    classes: Annotated[str | None, typer.Option(help="Class names in output order.")] = None,
    positive: Annotated[str | None, typer.Option(help="Defect classes (reject).")] = None,
    parent: Annotated[int | None, typer.Option(help="Parent version (default: latest).")] = None,
    run: Annotated[str | None, typer.Option(help="Run that produced the model.")] = None,
    data: Annotated[str | None, typer.Option(help="Data the model was trained on.")] = None,
    weights: Annotated[
        Path | None, typer.Option(help="Trainable weights (.npz of the state dict).")
    ] = None,
    family: Annotated[
        str | None, typer.Option(help="Model family that builds the weights, e.g. inspection-cnn.")
    ] = None,
    param: Annotated[
        list[str] | None, typer.Option(help="Family size parameter KEY=INT (repeatable).")
    ] = None,
    image_size: Annotated[
        int | None, typer.Option(help="Input image side (preprocessing travels with the model).")
    ] = None,
    channels: Annotated[int, typer.Option(help="Input channels (1 gray, 3 RGB).")] = 1,
    threshold: Annotated[
        float | None, typer.Option(help="Recommended decision threshold in [0, 1].")
    ] = None,
    class_threshold: Annotated[
        list[str] | None,
        typer.Option(help="Recommended threshold of one class, CLASS=VALUE (repeatable)."),
    ] = None,
    latency_budget_ms: Annotated[
        float | None,
        typer.Option(help="p95 latency (ms) it must keep on a station, or it is rolled back."),
    ] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Store, hash, sign and register an ONNX model (trainable with --weights --family).

    --threshold and --class-threshold are the thresholds recommended with this version:
    an edge serving it applies them unless its config was set for this very version.

    Example: fedge model publish model.onnx --name inspect --version 3 --classes clean,scratch
    --positive scratch --weights weights.npz --family inspection-cnn --param width=16
    --image-size 32
    """
    from fedge.edge_manager.registry import TrainableSource
    from fedge.protocols.errors import ProtocolError
    from fedge.protocols.manifest import Preprocess

    if (weights is None) != (family is None):
        raise typer.BadParameter("--weights and --family go together")
    params: dict[str, int] = {}
    for item in param or []:
        key, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise typer.BadParameter(f"--param {item!r} must be KEY=INTEGER, e.g. width=16")
        params[key] = int(value)
    try:
        preprocess = None if image_size is None else Preprocess(image_size, channels)
    except ProtocolError as exc:
        raise typer.BadParameter(str(exc)) from None
    if weights is not None and preprocess is None:
        raise typer.BadParameter("a trainable model needs --image-size (its preprocessing)")
    thresholds = _thresholds(threshold, class_threshold or [])
    _, fleet = open_fleet(home)
    published = fleet.registry.publish(
        path,
        name=name,
        version=version,
        classes=_split(classes),
        positive_classes=_split(positive),
        lineage=Lineage(parent, run, data) if (parent or run or data) else None,
        preprocess=preprocess,
        trainable=None
        if weights is None or family is None
        else TrainableSource(weights, family, params),
        thresholds=thresholds,
        latency_budget_ms=latency_budget_ms,
    )
    console.print(
        _published_line(published.manifest), markup=False, highlight=False, soft_wrap=True
    )


def _thresholds(default: float | None, per_class: list[str]) -> Thresholds | None:
    """--threshold and --class-threshold as the manifest's recommended thresholds."""
    from fedge.protocols.errors import ProtocolError

    classes: dict[str, float] = {}
    for item in per_class:
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not name.strip() or number is None:
            raise typer.BadParameter(
                f"{item!r} must be CLASS=VALUE, e.g. scratch=0.3", param_hint="--class-threshold"
            )
        classes[name.strip()] = number
    if default is None and not classes:
        return None
    try:
        # Without --threshold the class thresholds stand alone over the usual 0.5.
        return Thresholds(0.5 if default is None else default, classes)
    except ProtocolError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command("list")
@friendly_errors
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """List published models.

    Example: fedge model list
    """
    _, fleet = open_fleet(home)
    rows = fleet.registry.list()
    if as_json:
        print_json(
            [
                {
                    **row,
                    "ref": f"{row['name']}:{row['version']}",
                    "classes": str(row["classes"]).split(","),
                }
                for row in rows
            ]
        )
        return
    table = fitted_table(
        "model", "sha256", "size", "classes", "parent", "run", "published", whole=("sha256",)
    )
    for row in rows:
        table.add_row(
            f"{row['name']}:{row['version']}",
            str(row["sha256"])[:12],
            str(row["size"]),
            ", ".join(str(row["classes"]).split(",")),  # wraps at spaces, not inside a name
            "-" if row["parent_version"] is None else f"{row['name']}:{row['parent_version']}",
            str(row["run_id"] or "-"),
            when(row["created_at"]),  # type: ignore[arg-type]
        )
    console.print(table)


@app.command("train-teacher")
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
    from fedge.sim.data import make_partitions
    from fedge.sim.scenario import load_scenario
    from fedge.students import edge as edge_student

    loaded = load_scenario(scenario)
    teacher = edge_student.train_teacher(loaded, seed, arch)
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


@app.command()
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
    from fedge.sim.scenario import load_scenario
    from fedge.students import edge as edge_student

    # Open the registry first: a wrong --home fails before any training.
    fleet = open_fleet(home)[1] if publish_to_registry else None
    if fleet is not None and version is None:
        version = (fleet.registry.latest_version(name) or 0) + 1
    loaded = load_scenario(scenario)
    resolved = edge_student.resolve_teacher(teacher, loaded, seed)
    student, report = edge_student.distill_student(
        resolved, loaded, seed, arch,
        temperature=edge_student.TEMPERATURE if temperature is None else temperature,
    )  # fmt: skip
    check = edge_student.export_student(student, out, loaded, seed)
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
            _published_line(published.manifest), markup=False, highlight=False, soft_wrap=True
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
    from fedge.edge_manager.registry import parse_ref
    from fedge.sim.defects import make_defect_images
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
            _published_line(published.manifest), markup=False, highlight=False, soft_wrap=True
        )

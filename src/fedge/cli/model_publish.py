"""``fedge model publish``: store, hash, sign and register a model version."""

import time
from pathlib import Path
from typing import Annotated

import typer

from fedge.cli.common import DEFAULT_HOME, HomeOption, console, friendly_errors, open_fleet
from fedge.cli.jobs import WhoOption, _who
from fedge.edge_manager.registry.versions import TrainableSource
from fedge.edge_manager.scheduler import owned_models
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import Lineage, ModelManifest, Preprocess, Thresholds


def _split(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


def published_line(manifest: ModelManifest) -> str:
    """One plain line about a newly published version (no reprs: people read it)."""
    lineage = manifest.lineage
    parent = "-" if lineage.parent_version is None else f"{manifest.name}:{lineage.parent_version}"
    line = (
        f"published {manifest.ref} sha256={manifest.sha256[:12]}… size={manifest.size} "
        f"classes={','.join(manifest.classes)} parent={parent}"
    )
    return f"{line}; {lineage.note}" if lineage.note else line


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
    team: Annotated[
        str | None,
        typer.Option(
            help="The team that owns it: only its members see it, its submitters deploy it."
        ),
    ] = None,
    who: WhoOption = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Store, hash, sign and register an ONNX model (trainable with --weights --family).

    --threshold and --class-threshold are the thresholds recommended with this version:
    an edge serving it applies them unless its config was set for this very version.

    Example: fedge model publish model.onnx --name inspect --version 3 --classes clean,scratch
    --positive scratch --weights weights.npz --family inspection-cnn --param width=16
    --image-size 32
    """
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
    if team is not None:  # refused before anything is published
        owned_models.check_team(fleet.store, team, _who(who))
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
    if team is not None:
        owned_models.own(fleet.store, name, version, team, who=_who(who), now=time.time())
    line = published_line(published.manifest) + ("" if team is None else f"; team {team}")
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def _thresholds(default: float | None, per_class: list[str]) -> Thresholds | None:
    """--threshold and --class-threshold as the manifest's recommended thresholds."""
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

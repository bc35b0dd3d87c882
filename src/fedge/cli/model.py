"""``fedge model``: publish and list model versions."""

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fedge.cli.common import DEFAULT_HOME, HomeOption, console, friendly_errors, open_fleet
from fedge.protocols.manifest import Lineage

app = typer.Typer(help="The model registry.", no_args_is_help=True)


def _split(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


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
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Store, hash, sign and register an ONNX model.

    Example: fedge model publish model.onnx --name inspect --version 3 --classes clean,scratch
    --positive scratch
    """
    _, fleet = open_fleet(home)
    published = fleet.registry.publish(
        path,
        name=name,
        version=version,
        classes=_split(classes),
        positive_classes=_split(positive),
        lineage=Lineage(parent, run, data) if (parent or run or data) else None,
    )
    manifest = published.manifest
    console.print(
        f"published [bold]{manifest.ref}[/bold] sha256={manifest.sha256[:12]}… "
        f"size={manifest.size} classes={','.join(manifest.classes)} "
        f"parent={manifest.lineage.parent_version}"
    )


@app.command("list")
@friendly_errors
def list_models(home: HomeOption = DEFAULT_HOME) -> None:
    """List published models.

    Example: fedge model list
    """
    _, fleet = open_fleet(home)
    table = Table("model", "sha256", "size", "classes", "parent", "run")
    for row in fleet.registry.list():
        table.add_row(
            f"{row['name']}:{row['version']}",
            str(row["sha256"])[:12],
            str(row["size"]),
            str(row["classes"]),
            str(row["parent_version"] or "-"),
            str(row["run_id"] or "-"),
        )
    console.print(table)

"""``fedge model``: the model registry -- publish, list, gate and distil model versions.

This module only wires the commands; each lives in its own module.
"""

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
from fedge.cli.model_distill import distill, train_teacher
from fedge.cli.model_publish import publish
from fedge.edge_manager.scheduler import owned_models

app = typer.Typer(help="The model registry.", no_args_is_help=True)
# The validation gate (cli/gate.py): `fedge model gate inspect:4`.
app.command("gate")(gate)
app.command()(publish)  # cli/model_publish.py


@app.command("list")
@friendly_errors
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    team: Annotated[str | None, typer.Option(help="Only the models this team owns.")] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """List published models (--team: a team's own).

    Example: fedge model list --team vision
    """
    _, fleet = open_fleet(home)
    rows = fleet.registry.list()
    if team is not None:
        owned_models.check_known(fleet.store, team)
        owners = owned_models.owners(fleet.store)
        rows = [row for row in rows if owners.get((row.name, row.version)) == team]
    if as_json:
        print_json([row.to_json() for row in rows])
        return
    table = fitted_table(
        "model", "sha256", "size", "classes", "parent", "run", "published", whole=("sha256",)
    )
    for row in rows:
        table.add_row(
            row.ref,
            row.sha256[:12],
            str(row.size),
            ", ".join(row.classes),  # wraps at spaces, not inside a name
            "-" if row.parent_version is None else f"{row.name}:{row.parent_version}",
            row.run_id or "-",
            when(row.created_at),
        )
    console.print(table)


# Distillation (cli/model_distill.py).
app.command("train-teacher")(train_teacher)
app.command()(distill)

"""``fedge labels``: operator labels and per-edge agreement statistics."""

from typing import Annotated

import typer
from rich.table import Table

from fedge.cli.common import DEFAULT_HOME, HomeOption, console, friendly_errors, open_fleet

app = typer.Typer(help="Operator labels.", no_args_is_help=True)


@app.command()
@friendly_errors
def add(
    prediction_id: str,
    label: str,
    who: Annotated[str, typer.Option(help="Who labelled it.")] = "operator",
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Label a prediction that reached the manager.

    Example: fedge labels add p-1f3a... scratch --who alice
    """
    _, fleet = open_fleet(home)
    console.print(fleet.add_label(prediction_id, label, who))


@app.command()
@friendly_errors
def stats(home: HomeOption = DEFAULT_HOME) -> None:
    """Per-edge decisions and label agreement.

    Example: fedge labels stats
    """
    _, fleet = open_fleet(home)
    table = Table("edge", "predictions", "rejects", "labels", "agreement")
    for row in fleet.list():
        view = fleet.show(row["edge"])
        agreement = view["label_agreement"]
        table.add_row(
            row["edge"],
            str(view["predictions"]),
            str(view["rejects"]),
            str(view["labels"]),
            "-" if agreement is None else f"{agreement:.0%}",
        )
    console.print(table)

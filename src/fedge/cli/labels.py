"""``fedge labels``: operator labels and per-edge agreement statistics."""

from typing import Annotated

import typer
from rich.markup import escape

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    err_console,
    fitted_table,
    friendly_errors,
    open_fleet,
    print_json,
    warn_if_not_serving,
    when,
)
from fedge.console.queue import ORDERS, QueueQuery, label_queue
from fedge.edge_manager.labels.current import Applied

app = typer.Typer(help="Operator labels.", no_args_is_help=True)


@app.command()
@friendly_errors
def add(
    prediction_id: str,
    label: str,
    who: Annotated[str, typer.Option(help="Who labelled it.")] = "operator",
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Label a prediction that reached the manager, or relabel it.

    A prediction has one current label: a new one replaces it, and the old one is kept in
    its history (`fedge predictions show`). Prints the label id, then what changed.

    Example: fedge labels add p-1f3a... scratch --who alice
    """
    _, fleet = open_fleet(home)
    label_id, outcome = fleet.add_label(prediction_id, label, who)
    console.print(label_id, highlight=False)
    previous = outcome.previous
    if outcome.applied is Applied.UNCHANGED and previous is not None:
        err_console.print(
            f"{escape(prediction_id)} is already labelled {escape(label)} (by "
            f"{escape(previous.who)} at {when(previous.at)}); nothing was changed",
            highlight=False,
        )
        return
    if outcome.applied is Applied.RELABELLED and previous is not None:
        err_console.print(
            f"relabelled {escape(prediction_id)}: {escape(previous.label)} -> {escape(label)} "
            f"(was labelled by {escape(previous.who)} at {when(previous.at)}, "
            f"{previous.origin.value})",
            highlight=False,
        )
    warn_if_not_serving(home, "the label is stored and is sent to its edge once it runs")


@app.command()
@friendly_errors
def stats(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Per-edge decisions and label agreement.

    Example: fedge labels stats
    """
    _, fleet = open_fleet(home)
    views = [fleet.show(row.edge) for row in fleet.list()]
    if as_json:
        print_json(
            [
                {
                    "edge": view.edge,
                    "predictions": view.predictions,
                    "accepts": view.accepts,
                    "rejects": view.rejects,
                    "labels": view.labels,
                    "label_agreement": view.label_agreement,
                }
                for view in views
            ]
        )
        return
    table = fitted_table("edge", "predictions", "rejects", "labels", "agreement")
    for view in views:
        agreement = view.label_agreement
        table.add_row(
            view.edge,
            str(view.predictions),
            str(view.rejects),
            str(view.labels),
            "-" if agreement is None else f"{agreement:.0%}",
        )
    console.print(table)


@app.command()
@friendly_errors
def queue(
    edge: Annotated[str, typer.Option(help="Only this edge's predictions.")] = "",
    order: Annotated[str, typer.Option(help="margin (least certain first) or newest.")] = "margin",
    limit: Annotated[int, typer.Option(help="How many to show (one page).", min=1, max=25)] = 25,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """What to label first: the console's label queue.

    Novel parts lead (over their station's anomaly threshold, and called clean or
    rejected without confidence), then
    the least certain (or the newest). Label one with `fedge labels add`.

    Example: fedge labels queue --edge st-02 --limit 10
    """
    if order not in ORDERS:
        raise typer.BadParameter(f"--order is one of {', '.join(ORDERS)}, got {order!r}")
    _, fleet = open_fleet(home)
    found = label_queue(fleet, QueueQuery(edge=edge, order=order))
    items = found.items[:limit]
    if as_json:
        print_json(
            {
                "rule": found.rule,
                "total": found.total,
                "items": [
                    {
                        "prediction_id": i.prediction.prediction_id,
                        "edge": i.prediction.edge,
                        "model": i.prediction.model,
                        "decision": i.prediction.decision,
                        "novel": i.prediction.novel,
                        "anomaly_score": i.prediction.anomaly_score,
                        "margin": i.margin,
                        "at": i.prediction.at,
                    }
                    for i in items
                ],
            }
        )
        return
    table = fitted_table("prediction", "edge", "model", "decision", "novel", "anomaly", "margin")
    for i in items:
        p = i.prediction
        table.add_row(
            p.prediction_id,
            p.edge,
            p.model,
            p.decision,
            "novel" if p.novel else "",
            "-" if p.anomaly_score is None else f"{p.anomaly_score:.2f}",
            "-" if i.margin is None else f"{i.margin:.3f}",
        )
    console.print(table)
    console.print(f"{found.total} unlabelled; order: {found.rule}", highlight=False)

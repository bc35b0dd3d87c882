"""``fedge predictions``: find the predictions that reached the manager (ids to label)."""

from typing import Annotated

import typer
from rich.markup import escape

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
from fedge.edge_manager.fleet.predictions import (
    PredictionFilter,
    PredictionView,
    get_prediction,
    wait_for_predictions,
)

app = typer.Typer(help="Predictions the stations reported.", no_args_is_help=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _scores(view: PredictionView) -> str:
    return ", ".join(f"{name} {score:.3f}" for name, score in sorted(view.scores.items()))


@app.command("list")
@friendly_errors
def list_predictions(
    edge: Annotated[str | None, typer.Option(help="Only this edge.")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model version, e.g. inspect:1.")] = (
        None
    ),
    decision: Annotated[str | None, typer.Option(help="Only 'accept' or 'reject'.")] = None,
    unlabelled: Annotated[
        bool, typer.Option("--unlabelled", help="Only predictions nobody has labelled yet.")
    ] = False,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 20,
    wait: Annotated[
        float,
        typer.Option(help="Seconds to wait for a first match (stations report every few s)."),
    ] = 0.0,
    as_json: JsonOption = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """List predictions, newest first: id, edge, model, decision, scores, labels.

    Example: fedge predictions list --edge st-01 --decision reject --unlabelled
    """
    selected = PredictionFilter(edge, model, decision, unlabelled, limit)
    _, fleet = open_fleet(home)
    views = wait_for_predictions(fleet.store, selected, max(0.0, wait))
    if as_json:
        print_json([view.to_dict() for view in views])
        return
    if not views:
        console.print("no predictions match", highlight=False)
        return
    # Scores are in `show` and --json: with them, 80 columns would have to fold the id.
    table = fitted_table(
        "prediction", "edge", "model", "decision", "at", "labels", whole=("prediction",)
    )
    for view in views:
        table.add_row(
            view.prediction_id,
            view.edge,
            view.model,
            view.decision,
            when(view.at),
            ", ".join(label.label for label in view.labels) or "-",
        )
    console.print(table)


@app.command()
@friendly_errors
def show(
    prediction_id: str,
    as_json: JsonOption = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """One prediction: where and when, which model and threshold, scores, its labels.

    Example: fedge predictions show p-1f3a...
    """
    _, fleet = open_fleet(home)
    view = get_prediction(fleet.store, prediction_id)
    if as_json:
        print_json(view.to_dict())
        return
    lines = [
        f"[bold]{escape(view.prediction_id)}[/bold]",
        f"  edge        {escape(view.edge)}",
        f"  at          {when(view.at)}",
        f"  model       {escape(view.model)} (config v{view.config_version})",
        f"  decision    {view.decision} at threshold {view.threshold:g}",
        f"  scores      {escape(_scores(view))}",
        f"  source      {escape(view.source)}",
        f"  latency     {view.latency_ms:.1f} ms",
    ]
    if not view.labels:
        lines.append("  labels      none")
    for label in view.labels:
        lines.append(
            f"  label       {escape(label.label)} by {escape(label.who)} at {when(label.at)} "
            f"({label.origin})"
        )
    for label in view.replaced_labels:
        lines.append(
            f"  relabelled  from {escape(label.label)} by {escape(label.who)} at "
            f"{when(label.at)} ({label.origin}), replaced at {when(label.replaced_at)}"
        )
    console.print("\n".join(lines), highlight=False)

"""``fedge alerts``: drift and estimated-accuracy alerts, acknowledgements, estimates."""

import time
from typing import Annotated, Any

import typer

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    fitted_table,
    friendly_errors,
    open_fleet,
    print_json,
    warn_if_not_serving,
    when,
)
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.alert_store import AlertView

app = typer.Typer(
    help=(
        "Alerts the manager's monitor raised (input or score drift, low estimated accuracy): "
        "the open ones (--all: cleared too); `clear ID` acknowledges one; `estimates` shows "
        "the label-free accuracy per window. Example: fedge alerts --edge st-01"
    ),
    invoke_without_command=True,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
EdgeOption = Annotated[str | None, typer.Option(help="Only this edge.")]


def _value(view: AlertView) -> str:
    """The measured value against its threshold (PSI for drift, accuracy for estimates)."""
    return f"{view.value:.2f}/{view.threshold:.2f}"


@app.callback()
@friendly_errors
def list_alerts(
    ctx: typer.Context,
    edge: EdgeOption = None,
    include_cleared: Annotated[
        bool, typer.Option("--all", help="Cleared alerts too, not only the open ones.")
    ] = False,
    as_json: JsonOption = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Open alerts, newest first (`--all`: cleared ones too).

    Example: fedge alerts --edge st-01
    """
    if ctx.invoked_subcommand is not None:
        return
    _, fleet = open_fleet(home)
    views = alert_store.list_alerts(fleet.store, edge=edge, include_cleared=include_cleared)
    if as_json:
        print_json([view.to_dict() for view in views])
        return
    if not views:
        console.print("no alerts" if include_cleared else "no open alerts", highlight=False)
        return
    # Which features drifted, the windows and the estimates are in --json.
    headers = ["alert", "edge", "model", "kind", "raised", "value"]
    table = fitted_table(*headers, *(["state"] if include_cleared else []), whole=("alert", "kind"))
    for view in views:
        cells = [
            view.alert_id,
            view.edge,
            view.model,
            view.kind,
            when(view.raised_at),
            _value(view),
        ]
        if include_cleared:
            cells.append("open" if view.is_open else f"cleared by {view.cleared_by}")
        table.add_row(*cells)
    console.print(table)


@app.command()
@friendly_errors
def clear(
    alert_id: str,
    who: Annotated[str, typer.Option(help="Who acknowledges it.")] = "operator",
    note: Annotated[str, typer.Option(help="Why (kept with the acknowledgement).")] = "",
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Acknowledge an open alert: it is cleared, and its condition is not raised again for
    that edge and model until it has stopped holding once.

    Example: fedge alerts clear a-3f9c... --who alice --note "lamp replaced"
    """
    _, fleet = open_fleet(home)
    view = alert_store.acknowledge(fleet.store, alert_id, who, note, time.time())
    console.print(
        f"cleared {view.alert_id} ({view.kind} on {view.edge}, {view.model}) by {view.cleared_by}",
        highlight=False,
    )
    warn_if_not_serving(home, "the acknowledgement is stored and published once it runs")


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f}"


@app.command()
@friendly_errors
def estimates(
    edge: EdgeOption = None,
    model: Annotated[str | None, typer.Option(help="Only this model, e.g. inspect:1.")] = None,
    limit: Annotated[
        int, typer.Option(min=1, help="At most this many windows, newest first.")
    ] = 20,
    as_json: JsonOption = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Label-free accuracy per edge, model and window: the MPP estimate, the mean top score
    (calibration baseline), and the true accuracy where labels arrived.

    Example: fedge alerts estimates --edge st-01
    """
    _, fleet = open_fleet(home)
    rows = alert_store.list_estimates(fleet.store, edge=edge, model=model, limit=limit)
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print(
            "no estimates yet (a window needs the monitor's minimum of predictions)",
            highlight=False,
        )
        return
    table = fitted_table(
        "edge", "model", "window end", "n", "mpp", "calibration", "labelled", "true"
    )
    for row in rows:
        table.add_row(
            row.edge,
            row.model,
            when(row.window_end),
            str(row.n),
            _fmt(row.mpp),
            _fmt(row.calibration),
            str(row.labelled),
            _fmt(row.true_accuracy),
        )
    console.print(table)

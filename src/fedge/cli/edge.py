"""``fedge edge``: enrol edges, push thresholds, see desired vs reported."""

import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    friendly_errors,
    open_fleet,
    print_json,
    write_secret_file,
)
from fedge.edge_manager.enrollment import enroll as enroll_edge

app = typer.Typer(help="Edges: enrolment, configuration, state.", no_args_is_help=True)


def _when(ts: Any) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(float(ts)).strftime("%H:%M:%S")


@app.command()
@friendly_errors
def enroll(
    edge: str,
    out: Annotated[Path, typer.Option(help="Where to write the agent.toml (0600).")],
    data_dir: Annotated[Path | None, typer.Option(help="Agent data dir on the device.")] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Create the edge's credentials and write its agent.toml.

    Example: fedge edge enroll st-01 --out st-01/agent.toml
    """
    manager_home, fleet = open_fleet(home)
    directory = (data_dir or out.parent.resolve() / "data").resolve()
    write_secret_file(out, enroll_edge(manager_home, fleet, edge, directory))
    console.print(f"enrolled [bold]{edge}[/bold]; agent config in {out}")


# A negative VALUE (e.g. -0.1) is an argument, not an unknown option: it then gets the
# library's range error rather than click's "No such option '-0'".
@app.command("set-threshold", context_settings={"ignore_unknown_options": True})
@friendly_errors
def set_threshold(
    edge: Annotated[str, typer.Argument(help="Edge id, or 'all'.")],
    value: Annotated[float, typer.Argument(help="Threshold in [0, 1].")],
    class_name: Annotated[str | None, typer.Option("--class", help="Only this class.")] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Push a new decision threshold to an edge (a new signed config version).

    Example: fedge edge set-threshold st-07 0.72 --class scratch
    """
    _, fleet = open_fleet(home)
    edges = fleet.edges() if edge == "all" else [edge]
    for pushed in fleet.set_threshold(edges, value, class_name):
        console.print(f"{pushed.edge}: desired config v{pushed.version} (threshold {value})")


@app.command("set-training")
@friendly_errors
def set_training(
    edge: Annotated[str, typer.Argument(help="Edge id, or 'all'.")],
    enable: Annotated[
        bool, typer.Option("--enable/--disable", help="Train as a federated party, or stop.")
    ] = True,
    max_minutes: Annotated[
        float, typer.Option(help="Longest local training of one round, in minutes.")
    ] = 10.0,
    threads: Annotated[int, typer.Option(help="CPU threads training may use.")] = 1,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Let a station train on its labelled images as a federated party (signed config).

    Example: fedge edge set-training st-01 --enable --max-minutes 10
    """
    from fedge.protocols.config import TrainingPolicy
    from fedge.protocols.errors import ProtocolError

    _, fleet = open_fleet(home)
    edges = fleet.edges() if edge == "all" else [edge]
    try:
        policy = TrainingPolicy(enabled=enable, max_minutes=max_minutes, threads=threads)
    except ProtocolError as exc:
        raise typer.BadParameter(str(exc)) from None
    state = f"enabled, {max_minutes:g} min, {threads} thread(s)" if enable else "disabled"
    for pushed in fleet.set_training(edges, policy):
        console.print(f"{pushed.edge}: desired config v{pushed.version} (training {state})")


@app.command()
@friendly_errors
def show(
    edge: str,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Desired vs reported config, liveness, model, counts and gaps of one edge.

    Example: fedge edge show st-01
    """
    _, fleet = open_fleet(home)
    view = fleet.show(edge)
    if as_json:
        print_json(view)
        return
    desired = view["desired_config"] or {}
    sync = "[green]in sync[/green]" if view["in_sync"] else "[yellow]converging[/yellow]"
    console.print(f"[bold]{edge}[/bold]  {view['state']} (session {view['session']})")
    console.print(f"  last seen      {_when(view['last_seen'])}")
    console.print(
        f"  config         desired v{view['desired_config_version']} "
        f"(threshold {desired.get('default_threshold', '-')}, "
        f"per class {desired.get('class_thresholds', {})}) / reported v{view['config_applied']} "
        f"{sync} {view['config_reason']}"
    )
    console.print(f"  serving        {view['serving'] or '-'}")
    deployment = f"{view['deploy_id'] or '-'} {view['deploy_stage']} {view['deploy_reason']}"
    console.print(f"  deployment     {deployment}")
    agreement = view["label_agreement"]
    console.print(
        f"  predictions    {view['predictions']} (accept {view['accepts']}, "
        f"reject {view['rejects']}); labels {view['labels']}; agreement "
        f"{'-' if agreement is None else f'{agreement:.0%}'}"
    )
    console.print(
        f"  telemetry      {view['telemetry']} records; rejected msgs {view['rejections']}"
    )
    gaps = ", ".join(f"{g['stream']} {g['from_seq']}..{g['to_seq']}" for g in view["gaps"])
    console.print(f"  gaps           {gaps or 'none'}")


@app.command("list")
@friendly_errors
def list_edges(home: HomeOption = DEFAULT_HOME) -> None:
    """All edges with state, model and config versions.

    Example: fedge edge list
    """
    _, fleet = open_fleet(home)
    table = Table("edge", "state", "session", "last seen", "serving", "config (desired/applied)")
    for row in fleet.list():
        table.add_row(
            row["edge"],
            row["state"],
            str(row["session"]),
            _when(row["last_seen"]),
            row["serving"] or "-",
            f"v{row['config_desired']}/v{row['config_applied']}",
        )
    console.print(table)

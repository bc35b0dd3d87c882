"""``fedge deploy``: roll a registry model out to edges."""

import time
from typing import Annotated

import typer
from rich.markup import escape

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    friendly_errors,
    open_fleet,
    warn_if_not_serving,
)
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.registry.versions import parse_ref
from fedge.edge_manager.scheduler import owned_models


@friendly_errors
def deploy(
    model: Annotated[str, typer.Argument(help="NAME:VERSION, e.g. inspect:3")],
    edges: Annotated[str | None, typer.Option(help="Comma-separated edge ids.")] = None,
    all_edges: Annotated[bool, typer.Option("--all", help="Every enrolled edge.")] = False,
    wait: Annotated[float, typer.Option(help="Seconds to wait for every edge to finish.")] = 0.0,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Deploy even to edges in an unfinished staged rollout (its rollback "
            "would undo this).",
        ),
    ] = False,
    anomaly: Annotated[
        str | None,
        typer.Option(
            help="NAME:VERSION of an anomaly model to serve beside it (e.g. inspect-anomaly:1): "
            "fetched, verified, swapped and rolled back with it.",
        ),
    ] = None,
    who: Annotated[
        str | None,
        typer.Option("--as", help="Who deploys: a team's model needs its submitter or admin."),
    ] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Deploy a model version; each edge downloads, verifies, smoke-tests and swaps.

    Example: fedge deploy inspect:3 --edges st-01,st-02 --wait 30
    Example: fedge deploy inspect:3 --anomaly inspect-anomaly:1 --all
    """
    if not edges and not all_edges:
        raise ManagerError("say which edges: --edges st-01,st-02 or --all")
    if edges and all_edges:
        # Issue 15: `--edges st-03 --all` went to the whole fleet.
        raise ManagerError("--edges and --all contradict each other: give one of them")
    name, version = parse_ref(model)
    _, fleet = open_fleet(home)
    owned_models.check_deploy(fleet.store, name, version, who)  # a team's model (issue 31)
    targets = fleet.edges() if all_edges else [e.strip() for e in (edges or "").split(",")]
    companion = None if anomaly is None else parse_ref(anomaly)
    deployment_id = fleet.deploy(name, version, targets, force=force, anomaly=companion)
    beside = "" if anomaly is None else f" (anomaly model {anomaly} beside it)"
    console.print(f"deployment {deployment_id}: {model}{beside} -> {', '.join(targets)}")
    warn_if_not_serving(home, "the deployment is stored and is sent to the edges once it runs")
    if wait <= 0:
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        progress = edge_store.deployment_progress(fleet.store, deployment_id)
        finished = [p for p in progress if p.stage in ("active", "failed")]
        if len(finished) == len(targets):
            for edge in finished:
                colour = "green" if edge.stage == "active" else "red"
                console.print(
                    f"  {edge.edge}: [{colour}]{edge.stage}[/{colour}] {escape(edge.reason)}"
                )
            if any(p.stage == "failed" for p in finished):
                raise typer.Exit(1)
            return
        time.sleep(0.2)
    raise ManagerError(f"deployment {deployment_id} not finished on all edges after {wait}s")

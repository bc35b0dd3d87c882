"""The ``fedge`` command."""

from typing import Annotated

import typer

from fedge import __version__
from fedge.cli import (
    agent,
    aggregator,
    alerts,
    bench,
    console,
    deploy,
    edge,
    jobs,
    labels,
    loop,
    manager,
    model,
    predictions,
    quickstart,
    rollout,
    sim,
    team,
)
from fedge.cli.common import friendly_errors

app = typer.Typer(
    help="fedge: federated, edge-to-cloud learning for factory fleets.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(manager.app, name="manager")
app.add_typer(agent.app, name="agent")
app.add_typer(model.app, name="model")
app.add_typer(edge.app, name="edge")
app.add_typer(labels.app, name="labels")
app.add_typer(predictions.app, name="predictions")
app.add_typer(alerts.app, name="alerts")
app.add_typer(bench.app, name="bench")
app.add_typer(aggregator.app, name="aggregator")
app.add_typer(console.app, name="console")
app.add_typer(rollout.app, name="rollout")
app.add_typer(loop.app, name="loop")
app.add_typer(jobs.app, name="jobs")
app.add_typer(team.app, name="team")
app.command("deploy")(deploy.deploy)
app.command("sim")(sim.sim)
app.command("quickstart")(quickstart.quickstart)


def _version(value: bool) -> None:
    if value:
        print(f"fedge {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """fedge: federated, edge-to-cloud learning for factory fleets."""


@app.command()
@friendly_errors
def demo(
    out: Annotated[str, typer.Option(help="Output directory.")] = "demo-out",
    console_port: Annotated[
        int | None,
        typer.Option(
            "--console",
            help="At the end, serve the operator console on this port (127.0.0.1) over the "
            "live fleet until Ctrl-C.",
        ),
    ] = None,
) -> None:
    """Run the whole fleet on this machine: broker, manager, agents, model, threshold, images.

    Example: fedge demo --out demo-out --console 8470
    """
    from pathlib import Path

    from fedge.demo.fleet import run_demo

    raise typer.Exit(run_demo(Path(out), console_port=console_port))

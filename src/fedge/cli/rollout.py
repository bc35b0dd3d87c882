"""``fedge rollout``: staged rollouts with abort criteria and automatic rollback."""

import time
from dataclasses import asdict
from typing import Annotated, Any

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
    warn_if_not_serving,
    when,
)
from fedge.edge_manager.registry.versions import parse_ref
from fedge.edge_manager.rollout import views as rollout_views
from fedge.edge_manager.rollout.machine import Step
from fedge.edge_manager.rollout.plan import RolloutError, make_plan
from fedge.edge_manager.rollout.service import Rollouts, default_edges
from fedge.edge_manager.scheduler import owned_models

app = typer.Typer(
    help="Staged rollouts: canary first, waves, abort criteria, rollback.", no_args_is_help=True
)

_SERVE = "the rollout is stored and moves once `fedge manager serve` runs"
_COLOURS = {
    "completed": "green",
    "degraded": "red",
    "aborted": "red",
    "rolled_back": "red",
    "paused": "yellow",
}


def _when(ts: Any) -> str:
    return when(None if ts is None else float(ts))


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@app.command()
@friendly_errors
def start(
    model: Annotated[str, typer.Argument(help="NAME:VERSION, e.g. inspect:4")],
    edges: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated target edges, or 'all' (every enrolled edge). Default: the "
            "edges deployed with a version of the model's name."
        ),
    ] = None,
    canary: Annotated[str, typer.Option(help="Comma-separated canary edges (moved first).")] = "",
    waves: Annotated[str, typer.Option(help="Cumulative shares of the rest.")] = "25%,50%,100%",
    health_window: Annotated[
        str, typer.Option(help="How long each wave is watched: 30s, 10m, 2h.")
    ] = "10m",
    abort_if: Annotated[
        str,
        typer.Option(
            help="Abort criteria, e.g. 'agreement_drop>0.02,failed_activation>0,error_rate>0.01'."
        ),
    ] = "failed_activation>0",
    activation_timeout: Annotated[
        str, typer.Option(help="A moved edge not active by then counts as failed: 10m.")
    ] = "10m",
    rollback_timeout: Annotated[
        str, typer.Option(help="An edge sent back not confirmed by then is given up on: 10m.")
    ] = "10m",
    wait_for_probation: Annotated[
        bool,
        typer.Option(
            help="A wave completes only once each moved station reported its own probation "
            "passed (the agent's probation_images / probation_s)."
        ),
    ] = True,
    probation_timeout: Annotated[
        str,
        typer.Option(help="A station with no probation verdict by then counts as failed: 15m."),
    ] = "15m",
    force_unblessed: Annotated[
        bool,
        typer.Option(
            "--force-unblessed", help="Roll out a model the gate did not bless (recorded)."
        ),
    ] = False,
    anomaly: Annotated[
        str | None,
        typer.Option(
            help="NAME:VERSION of an anomaly model to roll out beside it (e.g. "
            "inspect-anomaly:2): moved, judged and rolled back with it, as one pair.",
        ),
    ] = None,
    who: Annotated[
        str | None,
        typer.Option("--as", help="Who rolls it out: a team's model needs its submitter or admin."),
    ] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Start a staged rollout of a blessed model.

    Example: fedge rollout start inspect:4 --canary st-03 --waves 25%,50%,100%
    --health-window 10m --abort-if "agreement_drop>0.02,failed_activation>0"

    Example: fedge rollout start inspect:4 --anomaly inspect-anomaly:2 --canary st-03
    --abort-if "novel_rate>0.05,failed_activation>0"

    A failed activation (or none within --activation-timeout) always aborts the rollout,
    whatever --abort-if says; so does a station whose probation verdict has not come
    within --probation-timeout of its activation (unless --no-wait-for-probation).
    """
    name, version = parse_ref(model)
    _, fleet = open_fleet(home)
    owned_models.check_deploy(fleet.store, name, version, who)  # a team's model (issue 31)
    if anomaly is not None:  # so is the anomaly model beside it
        owned_models.check_deploy(fleet.store, *parse_ref(anomaly.strip()), who)
    if edges is None:
        targets = default_edges(fleet, name)
        if not targets:
            raise RolloutError(
                f"no edge is deployed with a version of {name}; name the target edges with "
                "--edges st-01,st-02 (or --edges all for every enrolled edge); nothing was started"
            )
    elif not edges.strip():
        raise RolloutError("--edges is empty: name the target edges or give 'all'")
    else:
        targets = fleet.edges() if edges.strip() == "all" else fleet.edges(_csv(edges))
    plan = make_plan(
        targets,
        canary=_csv(canary),
        waves=waves,
        health_window=health_window,
        abort_if=abort_if,
        activation_timeout=activation_timeout,
        rollback_timeout=rollback_timeout,
        wait_for_probation=wait_for_probation,
        probation_timeout=probation_timeout,
        anomaly=anomaly,
    )
    rollout_id = Rollouts(fleet).start(
        model, plan, now=time.time(), force_unblessed=force_unblessed
    )
    beside = "" if plan.anomaly is None else f" with anomaly model {plan.anomaly}"
    console.print(f"rollout {rollout_id}: {model}{beside} -> {len(plan.edges)} edge(s), pending")
    if force_unblessed:
        console.print("[yellow]--force-unblessed is recorded with the rollout[/yellow]")
    warn_if_not_serving(home, _SERVE)


@app.command()
@friendly_errors
def status(
    rollout_id: Annotated[str | None, typer.Argument(help="Rollout id (default: newest).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """A rollout's state, edges and events.

    Example: fedge rollout status r-1a2b3c4d5e
    """
    _, fleet = open_fleet(home)
    chosen = rollout_id or rollout_views.latest_id(fleet.store)
    if chosen is None:
        raise RolloutError("no rollout yet; start one with `fedge rollout start`")
    view = rollout_views.status(fleet.store, chosen)
    if as_json:
        print_json(view)
        return
    colour = _COLOURS.get(view["state"], "cyan")
    beside = view["plan"].get("anomaly")
    console.print(
        f"rollout [bold]{view['rollout_id']}[/bold] {view['model']}"
        + (f" with anomaly model {beside}" if beside else "")
        + f": [{colour}]{escape(view['label'])}[/{colour}]"
        + (f" -- {escape(view['reason'])}" if view["reason"] else "")
    )
    plan = view["plan"]
    console.print(
        f"waves {', '.join(f'{w * 100:g}%' for w in plan['waves'])}; health window "
        f"{plan['health_window_s']:g}s; abort if {', '.join(plan['abort_if'])}; timeouts: "
        f"activation {plan['activation_timeout_s']:g}s, rollback {plan['rollback_timeout_s']:g}s"
        + (
            f", probation {plan['probation_timeout_s']:g}s (waves wait for the verdicts)"
            if plan.get("wait_for_probation", True)
            else "; waves do not wait for the stations' probation verdicts"
        )
        + ("; [yellow]forced unblessed[/yellow]" if view["forced_unblessed"] else "")
    )
    table = fitted_table("edge", "wave", "state", "serving", "previous", "moved", whole=("edge",))
    for edge in view["edges"]:
        table.add_row(
            edge["edge"],
            "canary" if edge["wave"] == 0 else str(edge["wave"]),
            edge["state"],
            edge["serving"] or "-",
            (edge["previous_model"] or "-")
            + (f" + {edge['previous_anomaly']}" if edge.get("previous_anomaly") else ""),
            _when(edge["moved_at"]),
        )
    console.print(table)
    events = fitted_table("at", "event", "edge", "detail", title="events")
    for event in view["events"]:
        events.add_row(
            _when(event["at"]), event["kind"], event["edge"] or "-", escape(event["detail"])
        )
    console.print(events)


@app.command("list")
@friendly_errors
def list_rollouts(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Every rollout, newest first.

    Example: fedge rollout list
    """
    _, fleet = open_fleet(home)
    rows = rollout_views.list_rollouts(fleet.store)
    if as_json:
        print_json([asdict(row) for row in rows])
        return
    table = fitted_table("rollout", "model", "state", "moved", "started", whole=("rollout",))
    for row in rows:
        colour = _COLOURS.get(row.state, "cyan")
        table.add_row(
            row.rollout_id,
            row.model if row.anomaly is None else f"{row.model} + {row.anomaly}",
            f"[{colour}]{escape(row.label)}[/{colour}]",
            f"{row.moved}/{row.edges}",
            _when(row.created_at),
        )
    console.print(table)


def _operated(verb: str, rollout_id: str, result: Step, home_path: Any) -> None:
    console.print(f"rollout {rollout_id}: {verb}, now {result.state.value}")
    if result.roll_back:
        console.print(f"rolling back {', '.join(result.roll_back)} to their previous model")
    warn_if_not_serving(home_path, "the change is stored and acted on once it runs")


@app.command()
@friendly_errors
def pause(rollout_id: str, home: HomeOption = DEFAULT_HOME) -> None:
    """Hold a rollout's next waves (abort criteria are still watched).

    Example: fedge rollout pause r-1a2b3c4d5e
    """
    _, fleet = open_fleet(home)
    _operated("paused", rollout_id, Rollouts(fleet).pause(rollout_id, time.time()), home)


@app.command()
@friendly_errors
def resume(rollout_id: str, home: HomeOption = DEFAULT_HOME) -> None:
    """Let a paused rollout go on from its wave.

    Example: fedge rollout resume r-1a2b3c4d5e
    """
    _, fleet = open_fleet(home)
    _operated("resumed", rollout_id, Rollouts(fleet).resume(rollout_id, time.time()), home)


@app.command()
@friendly_errors
def abort(
    rollout_id: str,
    reason: Annotated[str, typer.Option(help="Recorded with the rollout.")] = "by operator",
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="On an aborted rollout still waiting for edges to confirm their previous "
            "model: end it now, the unconfirmed edges named (recorded).",
        ),
    ] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Stop a rollout and send every moved edge back to its previous model and thresholds.

    Example: fedge rollout abort r-1a2b3c4d5e
    """
    _, fleet = open_fleet(home)
    result = Rollouts(fleet).abort(rollout_id, time.time(), reason, force=force)
    _operated("aborted", rollout_id, result, home)
    if result.unconfirmed:
        console.print(
            f"[yellow]ended without confirmation from {', '.join(result.unconfirmed)}; "
            "check what they serve (`fedge edge show`)[/yellow]"
        )

"""``fedge loop``: continuous training -- when the fleet trains again, and what came of it."""

import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    fitted_table,
    friendly_errors,
    print_json,
    when,
)
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.registry import store as model_store
from fedge.edge_manager.store import Store

app = typer.Typer(
    help="Continuous training: train, gate and roll out again on new labels or alerts.",
    no_args_is_help=True,
)


@app.command()
@friendly_errors
def enable(
    model: Annotated[str, typer.Argument(help="Registry model name, e.g. inspect.")],
    job: Annotated[Path, typer.Option(help="Fleet job manifest the loop runs (TOML).")],
    min_new_labels: Annotated[
        int, typer.Option(help="Train again once this many new operator labels arrived.")
    ] = 200,
    or_on_alert: Annotated[
        list[str] | None,
        typer.Option(
            help="...or when such an alert is open: drift, input_drift, score_drift, "
            "accuracy_estimate (repeatable)."
        ),
    ] = None,
    canary: Annotated[str, typer.Option(help="Canary edges of the rollout (comma list).")] = "",
    waves: Annotated[str, typer.Option(help="Rollout waves, cumulative.")] = "25%,50%,100%",
    health_window: Annotated[str, typer.Option(help="Each wave's health window.")] = "10m",
    abort_if: Annotated[
        str, typer.Option(help="Rollout abort criteria.")
    ] = "failed_activation>0,error_rate>0.01",
    cooldown: Annotated[str, typer.Option(help="Least time between two loop runs.")] = "1h",
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Enable (or replace) the continuous-training policy of a model.

    Example: fedge loop enable inspect --job nightly.toml --min-new-labels 200
    --or-on-alert drift --canary st-03 --waves 25%,50%,100% --health-window 10m
    """
    from fedge.aggregator.fleet.manifest import load_fleet_manifest
    from fedge.edge_manager.errors import ManagerError
    from fedge.edge_manager.rollout.plan import parse_criteria, parse_duration, parse_waves
    from fedge.loop import run_store
    from fedge.loop.policy import LoopPolicy, alert_kinds, job_for

    manager_home = ManagerHome(home)
    load_fleet_manifest(job)  # the job must load as it is (every setting checked)
    text = job.read_text(encoding="utf-8")
    parse_waves(waves)
    parse_duration(health_window)
    parse_criteria(abort_if)
    policy = LoopPolicy(
        model=model,
        job=text,
        min_new_labels=min_new_labels,
        on_alerts=alert_kinds(or_on_alert or []),
        canary=tuple(e for e in canary.split(",") if e),
        waves=waves,
        health_window=health_window,
        abort_if=abort_if,
        cooldown_s=parse_duration(cooldown),
    )
    job_for(policy.job, f"{model}:1")  # the loop can set where the job starts
    store = Store(manager_home.db_path)
    try:
        if model_store.latest_version(store, model) is None:
            raise ManagerError(f"no version of model {model!r} is published (`fedge model list`)")
        run_store.save_policy(store, policy)
    finally:
        store.close()
    triggers = [f"{min_new_labels} new labels"] if min_new_labels else []
    triggers += sorted(policy.on_alerts)
    console.print(
        f"continuous training of [bold]{model}[/bold] enabled: on {' or '.join(triggers)}; "
        "`fedge loop run` carries it out",
        highlight=False,
    )


@app.command()
@friendly_errors
def disable(
    model: Annotated[str, typer.Argument(help="Registry model name.")],
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Disable a model's policy (a run in progress still ends; nothing new starts).

    Example: fedge loop disable inspect
    """
    import dataclasses

    from fedge.edge_manager.errors import ManagerError
    from fedge.loop import run_store

    store = Store(ManagerHome(home).db_path)
    try:
        policy = run_store.policy(store, model)
        if policy is None:
            raise ManagerError(f"model {model!r} has no loop policy (`fedge loop status`)")
        run_store.save_policy(store, dataclasses.replace(policy, enabled=False))
    finally:
        store.close()
    console.print(f"continuous training of [bold]{model}[/bold] disabled", highlight=False)


@app.command()
@friendly_errors
def status(
    model: Annotated[str | None, typer.Argument(help="Only this model.")] = None,
    home: HomeOption = DEFAULT_HOME,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Policies, what each would do now, and the latest runs with every step they took.

    Example: fedge loop status inspect
    """
    from fedge.loop import run_store
    from fedge.loop.policy import decide

    store = Store(ManagerHome(home).db_path)
    try:
        now = time.time()
        policies = [p for p in run_store.policies(store) if model in (None, p.model)]
        decisions = {p.model: decide(p, run_store.observe(store, p.model), now) for p in policies}
        recent = run_store.runs(store, model, limit=10)
        steps = {r.run_id: run_store.events(store, r.run_id) for r in recent}
    finally:
        store.close()
    if as_json:
        print_json(
            {
                "policies": [
                    {
                        "model": p.model,
                        "enabled": p.enabled,
                        "min_new_labels": p.min_new_labels,
                        "on_alerts": sorted(p.on_alerts),
                        "due": decisions[p.model].start,
                        "why": decisions[p.model].reason,
                    }
                    for p in policies
                ],
                "runs": [
                    {**r.__dict__, "state": r.state.value, "steps": steps[r.run_id]} for r in recent
                ],
            }
        )
        return
    table = fitted_table("model", "enabled", "trigger", "now", whole=("model",))
    for p in policies:
        trigger = [f"{p.min_new_labels} labels"] if p.min_new_labels else []
        trigger += sorted(p.on_alerts)
        table.add_row(
            p.model,
            "yes" if p.enabled else "no",
            " or ".join(trigger),
            escape(decisions[p.model].reason),
        )
    console.print(table)
    for run in recent:
        console.print(
            f"[bold]{run.run_id}[/bold] {run.model} [cyan]{run.state.value}[/cyan] "
            f"started {when(run.started_at)} on {escape(run.trigger)}"
            + (f" -> {run.candidate}" if run.candidate else "")
            + (f": {escape(run.reason)}" if run.reason else ""),
            highlight=False,
        )
        for step in steps[run.run_id]:
            console.print(
                f"  {when(float(str(step['at'])))} {step['step']}: {escape(str(step['detail']))}",
                highlight=False,
            )


@app.command()
@friendly_errors
def run(
    once: Annotated[bool, typer.Option(help="One pass, then exit.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between passes.")] = 30.0,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Carry out the policies: trigger, train across the fleet, gate, roll out.

    Runs until stopped (Ctrl-C); a run it was in the middle of continues at the next start.
    Example: fedge loop run --once
    """
    from fedge.cli.common import setup_logging
    from fedge.loop.runner import LoopRunner
    from fedge.loop.steps import manager_wiring

    setup_logging()
    manager_home = ManagerHome(home)
    runner = LoopRunner(manager_home, manager_wiring(manager_home))
    while True:
        try:
            touched = runner.tick()
        except Exception:
            if once:
                raise
            # A pass that failed (a locked store, a full disk) is tried again: the runs
            # are in the store, and the next pass continues them where they were.
            logging.getLogger("fedge.loop").exception("loop pass failed; next in %ss", interval)
            touched = []
        for done in touched:
            console.print(
                f"loop run {done.run_id} of {done.model}: {done.state.value}"
                + (f" ({escape(done.reason)})" if done.reason else ""),
                highlight=False,
            )
        if once:
            return
        time.sleep(interval)

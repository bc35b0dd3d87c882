"""``fedge sim``: compare strategies on a simulated heterogeneous fleet."""

import json
import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedge.bench.machine import machine_info
from fedge.cli.common import console, fitted_table, friendly_errors


@friendly_errors
def sim(
    scenario: Annotated[
        str | None, typer.Option(help="Scenario name (shipped) or TOML path.")
    ] = None,
    strategies: Annotated[str, typer.Option(help="Comma-separated; the first is the baseline.")] = (
        "fedavg,tiered"
    ),
    seeds: Annotated[int, typer.Option(help="Seeds 0..N-1.")] = 1,
    backend: Annotated[str, typer.Option(help="inprocess (default) or flower.")] = "inprocess",
    rounds: Annotated[int | None, typer.Option(help="Override the scenario's rounds.")] = None,
    parties: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Run the scenario's fleet at this size (groups keep their shares; "
            "a scenario with data.samples_per_party scales its data too).",
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="With --backend flower: run on this existing Ray cluster (HOST:PORT of its "
            "head) instead of a private Ray on this machine."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Report directory [default: a new sim-out/SCENARIO-YYYYmmdd-HHMMSS per run].",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the report an earlier run left in --out.")
    ] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the summary.")] = None,
    sweep: Annotated[
        Path | None,
        typer.Option(
            help="Search a strategy's settings with Optuna instead (a sweep spec TOML: see "
            "docs/jobs.md); trials run as BE jobs on the scheduler, the best is written as "
            "a fleet job manifest in --out."
        ),
    ] = None,
) -> None:
    """Simulate the scenario's parties under each strategy and compare time to accuracy.

    Runs take from half a minute (tifl-digits: 20-30 s a seed and strategy) to a quarter
    of an hour and more (tifl-digits-mixed, 3 strategies: about 4 min a seed, on 2 cores;
    its fedavg-large and nested alone: about 30 s a seed): the progress bar shows rounds
    done and time elapsed. Every run writes its own report directory.

    Example: fedge sim --scenario tifl-digits --strategies fedavg,tiered --seeds 5 --json out.json

    Example: fedge sim --scenario tifl-digits-mixed --strategies fedavg-large,nested --seeds 5

    Example: fedge sim --sweep examples/sweeps/tiered-digits.toml --out sweeps/tiered
    """
    if sweep is not None:
        _sweep(sweep, out, json_path)
        return
    if scenario is None:
        raise typer.BadParameter("give --scenario (or --sweep SPEC)", param_hint="--scenario")
    # Imported here, not at start-up: the simulator needs torch and Flower, which an
    # inference-only station (`pip install 'fedge[agent]'`) does not have.
    from fedge.sim.report import report_dir, speedup_text, write_report
    from fedge.sim.runner import compare
    from fedge.sim.scenario import load_scenario

    logging.getLogger("flwr").setLevel(logging.WARNING)
    loaded = load_scenario(scenario)
    if rounds is not None:
        loaded = loaded.with_rounds(rounds)
    if parties is not None:
        loaded = loaded.with_parties(parties)
    if ray_address and backend != "flower":
        raise typer.BadParameter("--ray-address needs --backend flower", param_hint="--ray-address")
    names = [s.strip() for s in strategies.split(",") if s.strip()]
    for name in names:
        loaded.strategy(name)  # unknown names fail before anything runs
    out = report_dir(out, loaded.name, force=force, now=time.time())  # before, not after
    total = seeds * sum(loaded.rounds_for(name) for name in names)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("simulating", total=total)

        def advance(label: str, server_round: int, of: int) -> None:
            progress.update(task, advance=1, description=label)

        comparison = compare(
            loaded,
            names,
            range(seeds),
            backend=backend,
            progress=advance,
            ray_address=ray_address,
        )
    md, png, summary = write_report(comparison, out, loaded)
    table = fitted_table(
        "strategy",
        "median TTA (s)",
        "censored",
        "final acc",
        "converged acc",
        "worst group acc",
        whole=("strategy",),
    )
    tta = summary["time_to_target_s"]
    assert isinstance(tta, dict)
    for name in names:
        values = [v for v in tta[name].values() if v is not None]
        median = sorted(values)[len(values) // 2] if values else None
        table.add_row(
            name,
            "-" if median is None else f"{median:.1f}",
            str(summary["censored"][name]),  # type: ignore[index]
            f"{summary['final_accuracy'][name]:.4f}",  # type: ignore[index]
            f"{summary['converged_accuracy'][name]:.4f}",  # type: ignore[index]
            f"{summary['worst_tier_accuracy'][name]:.4f}",  # type: ignore[index]
        )
    console.print(table)
    speedup = summary.get("tta_speedup")
    if isinstance(speedup, dict):
        console.print(f"time-to-accuracy speed-up, {speedup_text(speedup, names[0])}", markup=False)
    costs = summary.get("privacy_cost")
    if isinstance(costs, dict):
        spent = summary["epsilon_spent"]
        assert isinstance(spent, dict)
        for name, cost in costs.items():
            drop, ratio = cost["converged_accuracy_drop_points"], cost["round_time_ratio"]
            console.print(
                f"privacy, {name} vs {names[0]}: epsilon spent {_num(spent[name])}, converged "
                f"accuracy {_num(drop)} points lower, {_num(ratio)}x the wall time per round",
                markup=False,
            )
    summary["machine"] = machine_info()
    summary["backend"] = backend
    summary["parties"] = loaded.fleet.parties
    if ray_address:
        summary["ray_address"] = ray_address
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=1, default=str))
    console.print(f"report: {md}\nplot:   {png}", markup=False, highlight=False)


def _num(value: object) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.2f}"


def _sweep(spec_path: Path, out: Path | None, json_path: Path | None) -> None:
    """``fedge sim --sweep``: a bad spec is one red line, and nothing is queued."""
    from fedge.sim.sweep.run import run_sweep
    from fedge.sim.sweep.spec import load_sweep

    logging.getLogger("flwr").setLevel(logging.WARNING)
    spec = load_sweep(spec_path)
    out = out or Path("sweeps") / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"

    report = run_sweep(
        spec,
        out,
        on_trial=lambda t: console.print(
            f"{t.job_id}: {t.state}"
            + ("" if t.accuracy is None else f", accuracy {t.accuracy:.4f}")
            + f" {t.params}",
            markup=False,
            highlight=False,
        ),
    )
    table = fitted_table("rank", "trial", "accuracy", "settings", whole=("settings",))
    for rank, t in enumerate(report.ranked, 1):
        accuracy = "failed" if t.accuracy is None else f"{t.accuracy:.4f}"
        settings = ", ".join(f"{k}={v:g}" for k, v in t.params.items())
        table.add_row(str(rank), t.job_id, accuracy, settings)
    console.print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=1))
    if report.fleet_manifest:
        console.print(
            f"best: {report.fleet_manifest}\nqueue it: fedge jobs submit --manifest "
            f"{report.fleet_manifest} --job-dir JOB_DIR --kind be --team TEAM",
            markup=False,
            highlight=False,
        )

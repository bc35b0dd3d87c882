"""``fedge aggregator``: run, watch, halt and resume federated training jobs.

The commands only parse options and call :mod:`fedge.sim.jobs` (simulated jobs),
:mod:`fedge.federation.fleet_job` (fleet jobs) and :mod:`fedge.aggregator.jobs.control`; a job
lives in its
directory (``--dir``), so any command can follow up on a job another one started.
"""

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedge.cli.common import DEFAULT_HOME, HomeOption, console, fitted_table, friendly_errors, when

if TYPE_CHECKING:
    from fedge.aggregator.jobs.runner import JobResult, ProgressFn
    from fedge.federation.fleet_job import FleetJobResult

app = typer.Typer(
    help="Federated training jobs: run a job manifest, watch, halt and resume it.",
    no_args_is_help=True,
)

DirOption = Annotated[
    Path,
    typer.Option(
        "--dir",
        envvar="FEDGE_JOB_DIR",
        help="Job directory (manifest copy, run store, checkpoints, final model).",
        show_default=True,
    ),
]
DEFAULT_DIR = Path("fedge-job")
VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Also show Flower's per-round log lines.")
]
MetricsPortOption = Annotated[
    int,
    typer.Option(
        "--metrics-port",
        min=0,
        help="Serve the job's Prometheus metrics (rounds, round times, late and dropped "
        "parties, epsilon) on 127.0.0.1:PORT while it runs; 0: off.",
    ),
]


@app.command()
@friendly_errors
def run(
    manifest: Annotated[Path, typer.Argument(help="Job manifest (TOML).", show_default=False)],
    job_dir: DirOption = DEFAULT_DIR,
    verbose: VerboseOption = False,
    home: HomeOption = DEFAULT_HOME,
    metrics_port: MetricsPortOption = 0,
) -> None:
    """Validate a job manifest, then run it to the end, checkpointing every round.

    A fleet job (`[federation] backend = "fleet"`) trains on the stations of the manager
    home's fleet through its SuperLink and ends by publishing the new model version.
    Exit code 0 when the job completed or was halted, 1 on a bad manifest or a failure.

    Example: fedge aggregator run examples/jobs/tiered-digits.toml --dir jobs/tiered
    """
    from fedge.aggregator.fleet.manifest import is_fleet_manifest
    from fedge.sim.jobs import run_job

    _quiet_flower(verbose)
    if manifest.is_file() and is_fleet_manifest(manifest.read_text(encoding="utf-8")):
        from fedge.edge_manager.home.layout import ManagerHome
        from fedge.federation.fleet_job import run_fleet_job

        with _job_metrics(job_dir, metrics_port), _progress_bar("fleet rounds") as progress:
            fleet_result = run_fleet_job(manifest, job_dir, ManagerHome(home), progress=progress)
        _report_fleet(fleet_result, job_dir)
        return
    with _job_metrics(job_dir, metrics_port), _progress_bar("training") as progress:
        result = run_job(manifest, job_dir, progress=progress)
    _report(result)


@app.command()
@friendly_errors
def resume(
    job_dir: DirOption = DEFAULT_DIR,
    verbose: VerboseOption = False,
    home: HomeOption = DEFAULT_HOME,
    metrics_port: MetricsPortOption = 0,
    manifest: Annotated[
        Path | None,
        typer.Option(
            help="A corrected manifest: only rounds, credits_per_tier, checkpoint and "
            "timeouts may differ from the job's."
        ),
    ] = None,
) -> None:
    """Continue a halted, failed or killed job from its newest checkpoint.

    Example: fedge aggregator resume --dir jobs/tiered --manifest tiered-more-credits.toml
    """
    from fedge.federation.fleet_job import is_fleet_job
    from fedge.sim.jobs import resume_job

    _quiet_flower(verbose)
    if manifest is not None:
        _amend(job_dir, manifest)
    if is_fleet_job(job_dir):
        from fedge.edge_manager.home.layout import ManagerHome
        from fedge.federation.fleet_job import resume_fleet_job

        with _job_metrics(job_dir, metrics_port), _progress_bar("fleet rounds") as progress:
            fleet_result = resume_fleet_job(job_dir, ManagerHome(home), progress=progress)
        _report_fleet(fleet_result, job_dir)
        return
    with _job_metrics(job_dir, metrics_port), _progress_bar("resuming") as progress:
        result = resume_job(job_dir, progress=progress)
    _report(result)


@contextmanager
def _job_metrics(job_dir: Path, port: int) -> Iterator[None]:
    """The job's /metrics on loopback while the block runs (issue 27), read from its run
    store on each scrape; nothing when ``port`` is 0."""
    if not port:
        yield
        return
    from fedge.aggregator.jobs.directory import RUNS_DB
    from fedge.aggregator.jobs.metrics import serve_job_metrics

    server = serve_job_metrics(job_dir / RUNS_DB, "127.0.0.1", port)
    server.start()
    console.print(f"job metrics: {server.url}/metrics", markup=False, highlight=False)
    try:
        yield
    finally:
        server.stop()


def _amend(job_dir: Path, manifest: Path) -> None:
    from fedge.aggregator.fleet.manifest import parse_fleet_manifest
    from fedge.aggregator.jobs.amend import amend_job
    from fedge.aggregator.jobs.control import require_job
    from fedge.aggregator.jobs.directory import JOB_MANIFEST, JOB_SCENARIO
    from fedge.federation.fleet_job import is_fleet_job
    from fedge.sim.job_manifest import parse_manifest

    require_job(job_dir)

    def parse_sim(text: str) -> object:  # read against the job's frozen scenario copy
        return parse_manifest(
            text, source=str(manifest), base_dir=job_dir, scenario_file=job_dir / JOB_SCENARIO
        )

    fleet = is_fleet_job(job_dir)
    amended = amend_job(job_dir, manifest, parse_fleet_manifest if fleet else parse_sim)
    if not amended.changes:
        console.print(f"{manifest} is the job's manifest as it is: nothing to amend")
        return
    for field, (old, new) in amended.changes.items():
        console.print(f"{field}: {old} -> {new}", highlight=False, markup=False)
    console.print(
        f"{job_dir / JOB_MANIFEST} amended (the previous one is {amended.previous})",
        highlight=False,
        markup=False,
    )


@app.command()
@friendly_errors
def halt(job_dir: DirOption = DEFAULT_DIR) -> None:
    """Ask a running job to stop after its current round (its checkpoint is kept).

    A job whose process was killed is marked halted at once. Resume it with
    `fedge aggregator resume`.

    Example: fedge aggregator halt --dir jobs/tiered
    """
    from fedge.aggregator.jobs.control import halt_job
    from fedge.aggregator.jobs.run_store import RunState

    state = halt_job(job_dir)
    if state is RunState.HALTED:
        console.print(f"job in {job_dir} halted (nobody was running it)")
    else:
        console.print(f"halt requested: the job in {job_dir} stops after its current round")


@app.command()
@friendly_errors
def status(
    job_dir: DirOption = DEFAULT_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show the job's runs: state, last round, last test accuracy, newest checkpoint.

    Example: fedge aggregator status --dir jobs/tiered --json
    """
    from fedge.aggregator.jobs.control import job_status

    statuses = job_status(job_dir)
    if as_json:
        typer.echo(json.dumps([s.to_dict() for s in statuses], indent=2))
        return
    # Folded, never cut: at 80 columns a state read "comple…" (issue 15).
    table = fitted_table(
        "run", "state", "round", "accuracy", "ckpt", "updated", "error", whole=("run",)
    )
    for s in statuses:
        state = s.state.value
        if s.live:
            state += " (live)"
        elif s.state.value in ("queued", "running"):
            state += " (no process: resume it)"
        if s.halt_requested and s.live:
            state += ", halt requested"
        table.add_row(
            s.run_id,
            state,
            f"{s.last_round}/{s.rounds}",
            "-" if s.accuracy is None else f"{s.accuracy:.4f}",
            "-" if s.checkpoint_round is None else str(s.checkpoint_round),
            when(s.updated_at),
            escape(s.error or "-"),
        )
    console.print(table)
    for s in statuses:
        if s.evaluations:
            console.print(_evaluation_table(s.run_id, s.evaluations))
        if s.privacy:
            console.print(_privacy_table(s.run_id, s.privacy))


def _privacy_table(run_id: str, rows: list[dict[str, Any]]) -> Table:
    """Each party's DP-SGD rounds and the epsilon it spent (job and lifetime)."""
    table = Table(
        "party",
        "DP rounds",
        "eps (job)",
        "eps (lifetime)",
        "last round",
        title=f"{run_id}: privacy spent",
    )
    for r in rows:
        table.add_row(
            escape(str(r["name"])),
            str(r["rounds"]),
            f"{float(r['epsilon_job']):.3f}",
            f"{float(r['epsilon_total']):.3f}",
            str(r["last_round"]),
        )
    return table


def _evaluation_table(run_id: str, rows: list[dict[str, Any]]) -> Table:
    """Stations x rounds: each station's accuracy on its own held-out images."""
    rounds = sorted({int(r["round"]) for r in rows})
    table = Table("station", *(f"r{n}" for n in rounds), title=f"{run_id}: held-out accuracy")
    by_station: dict[str, dict[int, str]] = {}
    for r in rows:
        shown = "failed" if r["accuracy"] is None else f"{float(r['accuracy']):.3f}"
        by_station.setdefault(str(r["party"]), {})[int(r["round"])] = shown
    for station, cells in sorted(by_station.items()):
        table.add_row(station, *(cells.get(n, "-") for n in rounds))
    return table


# ---------------------------------------------------------------- helpers


@contextmanager
def _progress_bar(title: str) -> "Iterator[ProgressFn]":
    """A per-round progress bar, shown from the job's first report (not on early errors);
    one line per round instead when stdout is not a terminal (a log, a pipe: issue 27,
    a bar redirected printed nothing until the job ended)."""
    if not console.is_terminal:
        yield _round_lines(title)
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rounds  acc {task.fields[accuracy]}"),
        TimeElapsedColumn(),
    )
    bar = Progress(*columns, console=console)
    task = bar.add_task(title, total=None, accuracy="-")

    def update(done: int, total: int, accuracy: float | None) -> None:
        shown = "-" if accuracy is None else f"{accuracy:.4f}"
        bar.update(task, completed=done, total=total, accuracy=shown)
        if not bar.live.is_started:
            bar.start()

    try:
        yield update
    finally:
        if bar.live.is_started:
            bar.stop()


def _round_lines(title: str) -> "ProgressFn":
    """One flushed line per finished round: ``training: round 3/10 done, accuracy 0.8123,
    12.4 s`` (a job's first report, before any round, prints nothing)."""
    started = time.monotonic()
    printed = -1

    def update(done: int, total: int, accuracy: float | None) -> None:
        nonlocal printed
        if done == printed or (done == 0 and printed < 0):
            printed = done
            return
        printed = done
        shown = "-" if accuracy is None else f"{accuracy:.4f}"
        elapsed = time.monotonic() - started
        line = f"{title}: round {done}/{total} done, accuracy {shown}, {elapsed:.1f} s"
        print(line, flush=True)

    return update


def _report(result: "JobResult") -> None:
    accuracy = "-" if result.accuracy is None else f"{result.accuracy:.4f}"
    line = (
        f"job {result.run_id} {result.state.value} after round "
        f"{result.last_round}/{result.rounds}, test accuracy {accuracy}"
    )
    if result.final_model is not None:
        line += f"; final model: {result.final_model}"
    else:
        line += f"; resume with: fedge aggregator resume --dir {result.job_dir}"
    console.print(line, highlight=False, soft_wrap=True)


def _report_fleet(result: "FleetJobResult", job_dir: Path) -> None:
    line = (
        f"fleet job {result.run_id} {result.state.value} after round "
        f"{result.last_round}/{result.rounds}"
    )
    if result.published is not None:
        line += f"; published {result.published}"
    if result.error:
        line += f"; {result.error}"
    if result.state.value != "completed":
        console.print(line, highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(0 if result.state.value == "halted" else 1)
    console.print(line, highlight=False, soft_wrap=True, markup=False)


def _quiet_flower(verbose: bool) -> None:
    if not verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)

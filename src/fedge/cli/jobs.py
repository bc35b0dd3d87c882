"""``fedge jobs``: the manager's job queue (issue 31): teams, submit, list, show, cancel,
priority. The scheduler (FitGpp preemption) lives in fedge.edge_manager.scheduler."""

import contextlib
import getpass
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from fedge.cli.common import DEFAULT_HOME, HomeOption, console, fitted_table, print_json, when
from fedge.cli.common import friendly_errors as _friendly
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.scheduler import service
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.policy import Policy, PolicyName
from fedge.edge_manager.scheduler.queue import Actions
from fedge.edge_manager.scheduler.store import JobRecord
from fedge.edge_manager.store import Store

app = typer.Typer(
    help="The fleet's job queue: TE (urgent) and BE (best-effort) jobs, by team. "
    "Example: fedge jobs submit --kind te --team vision --stations 'any 2' --grace 120",
    no_args_is_help=True,
)
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
WhoOption = Annotated[
    str | None,
    typer.Option(
        "--as",
        help="Who does it: an operator or console account, for the team's roles and the "
        "audit log (default: your login name).",
    ),
]


@contextmanager
def _store(home: Path) -> Iterator[Store]:
    manager_home = ManagerHome(home)
    if not manager_home.db_path.parent.is_dir():
        raise SchedulerError(f"no manager home at {home}; create one with: fedge manager init")
    store = Store(manager_home.db_path)
    try:
        yield store
    finally:
        store.close()


def _who(who: str | None) -> str:
    return who or getpass.getuser()


def _dict(record: JobRecord) -> dict[str, object]:
    job = record.job
    return {
        "job_id": job.job_id,
        "kind": job.kind.value,
        "team": job.team,
        "state": record.state.value,
        "demand": job.demand,
        "stations": None if job.stations is None else sorted(job.stations),
        "grace_s": job.grace_s,
        "max_preemptions": job.max_preemptions,
        "priority": job.priority,
        "preemptions": record.preemptions,
        "assigned": list(record.assigned),
        "job_dir": record.job_dir,
        "submitted_at": job.submitted_at,
        "submitted_by": record.submitted_by,
    }


@app.command()
@_friendly
def team(
    name: Annotated[str, typer.Argument(help="The team's name.")],
    quota: Annotated[
        float | None, typer.Option(help="Station-hours a day its jobs may use (none: no cap).")
    ] = None,
    who: WhoOption = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Add a team (or, as its admin, change its quota); its roles: fedge team grant.

    Example: fedge team add vision --quota 40   (or: fedge jobs team vision --quota 40)
    """
    with _store(home) as store:
        service.add_team(store, name, quota, who=_who(who), now=time.time())
    console.print(f"team {name}: quota {'none' if quota is None else f'{quota:g} station-h/day'}")


@app.command()
@_friendly
def submit(
    kind: Annotated[str, typer.Option(help="te (urgent, may preempt) or be (best effort).")],
    team: Annotated[str, typer.Option(help="The submitting team (see: fedge jobs team).")],
    stations: Annotated[
        str, typer.Option(help="'all', 'any N', 'any N of a,b,c' or 'a,b,c' (all of these).")
    ] = "all",
    grace: Annotated[
        float, typer.Option(help="Seconds to finish a round and checkpoint when preempted.")
    ] = 180.0,
    max_preemptions: Annotated[int, typer.Option(help="Preemptions it accepts.", min=0)] = 1,
    priority: Annotated[int, typer.Option(help="Higher runs first, within its kind.")] = 0,
    job_dir: Annotated[str, typer.Option(help="The fleet job directory it runs.")] = "",
    manifest: Annotated[
        Path | None,
        typer.Option(help="A fleet job manifest: checked now, run in --job-dir when placed."),
    ] = None,
    who: WhoOption = None,
    as_json: JsonOption = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Queue a job; a bad submission is one red line and queues nothing.

    Example: fedge jobs submit --kind be --team vision --stations 'any 2'
    --manifest retrain.toml --job-dir jobs/retrain
    """
    if manifest is not None and not job_dir:
        raise SchedulerError("--manifest needs --job-dir: where the job will run")
    now, by = time.time(), _who(who)
    with _store(home) as store:
        if manifest is not None:
            # Lazily: link_jobs brings Flower and torch, which `fedge --help` and a
            # station-only install must not import (tests/cli/test_startup.py).
            from fedge.federation.link_jobs import queue_fleet_job

            record = queue_fleet_job(
                store, manifest, Path(job_dir), kind=kind, team=team, stations=stations,
                grace_s=grace, max_preemptions=max_preemptions, priority=priority, who=by,
                now=now,
            )  # fmt: skip
        else:
            record = service.submit_job(
                store, kind=kind, team=team, stations=stations, grace_s=grace,
                max_preemptions=max_preemptions, priority=priority, job_dir=job_dir, who=by,
                now=now,
            )  # fmt: skip
    if as_json:
        print_json(_dict(record))
    else:
        console.print(f"queued {record.job.job_id}", highlight=False)


@app.command("list")
@_friendly
def list_jobs(as_json: JsonOption = False, home: HomeOption = DEFAULT_HOME) -> None:
    """Every job, oldest first.

    Example: fedge jobs list
    """
    with _store(home) as store:
        records = queue_store.jobs(store)
    if as_json:
        print_json([_dict(r) for r in records])
        return
    if not records:
        console.print("no jobs")
        return
    table = fitted_table("job", "kind", "team", "state", "stations", "prio", "submitted")
    for r in records:
        table.add_row(
            r.job.job_id,
            r.job.kind.value,
            r.job.team,
            r.state.value,
            ",".join(r.assigned) or str(r.job.demand),
            str(r.job.priority),
            when(r.job.submitted_at),
        )
    console.print(table)


@app.command()
@_friendly
def show(
    job_id: Annotated[str, typer.Argument(help="The job.")],
    as_json: JsonOption = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """A job and every change of its state (who, when, why).

    Example: fedge jobs show job-1a2b3c4d5e
    """
    with _store(home) as store:
        record = queue_store.job(store, job_id)
        history = queue_store.events(store, job_id)
    if as_json:
        print_json({**_dict(record), "events": history})
        return
    for key, value in _dict(record).items():
        console.print(f"{key}: {value}", highlight=False)
    table = fitted_table("at", "state", "who", "detail")
    for event in history:
        table.add_row(when(event.at), event.state, event.who, event.detail)
    console.print(table)


@app.command()
@_friendly
def cancel(
    job_id: Annotated[str, typer.Argument(help="The job.")],
    who: WhoOption = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Cancel a job: a waiting one now, a running one at its next round boundary.

    Example: fedge jobs cancel job-1a2b3c4d5e
    """
    with _store(home) as store:
        record = service.cancel(store, job_id, who=_who(who), now=time.time())
    console.print(f"{job_id}: {record.state.value}", highlight=False)


@app.command()
@_friendly
def priority(
    job_id: Annotated[str, typer.Argument(help="The job (waiting).")],
    value: Annotated[int, typer.Argument(help="The new priority (higher runs first).")],
    who: WhoOption = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Change a waiting job's priority.

    Example: fedge jobs priority job-1a2b3c4d5e 5
    """
    with _store(home) as store:
        service.set_priority(store, job_id, value, who=_who(who), now=time.time())
    console.print(f"{job_id}: priority {value}", highlight=False)


@app.command("run")
@_friendly
def run_jobs(
    policy: Annotated[
        PolicyName, typer.Option(help="fitgpp (preempts BE jobs for TE jobs), lrtp, rand, fifo.")
    ] = PolicyName.FITGPP,
    poll: Annotated[float, typer.Option(help="Seconds between scheduling steps.", min=0.1)] = 1.0,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Run the queue on the fleet's SuperLink until Ctrl-C: start, suspend and resume
    fleet jobs (needs `fedge manager superlink` running).

    Example: fedge jobs run --policy fitgpp
    """
    from fedge.federation.link_jobs import run_queue  # lazily: Flower and torch

    manager_home = ManagerHome(home)
    if not manager_home.db_path.is_file():
        raise SchedulerError(f"no manager home at {home}; create one with: fedge manager init")
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))

    def report(actions: Actions) -> None:
        for placement in actions.start:
            console.print(f"start {placement.job_id} on {','.join(placement.stations)}")
        for placement in actions.resume:
            console.print(f"resume {placement.job_id} on {','.join(placement.stations)}")
        for suspension in actions.suspend:
            console.print(f"suspend {suspension.job_id} for {suspension.for_job}")

    console.print(f"running the job queue ({policy.value}); Ctrl-C stops", highlight=False)
    with contextlib.suppress(KeyboardInterrupt):
        run_queue(
            manager_home, Policy(policy), poll_s=poll, stop=lambda: bool(stopping), on_step=report
        )

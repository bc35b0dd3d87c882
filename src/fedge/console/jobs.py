"""The jobs pages: the federated jobs run on this fleet, from their own run stores.

The manager records every fleet job prepared against it (``fleet_jobs``, written by
``federation.prepare``; continuous training's jobs go through the same call); each job's
directory holds the aggregator's run store (aggregator/jobs/run_store.py), which says what
each round did: its tier, who was selected, on time, late or failed (and why), the
round's time, whether the quorum was met, its metrics, and the privacy spent. The
console opens those stores to read; it never writes them.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.aggregator.jobs.directory import RUNS_DB
from fedge.aggregator.jobs.run_store import RunStore
from fedge.console import views_store
from fedge.console.accounts import Account, Role
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.scheduler import team_store

ACCURACY_KEYS = ("accuracy", "eval_accuracy", "federated_evaluate_accuracy")


@dataclass(frozen=True)
class JobSummary:
    job_id: str  # the position in fleet_jobs, what the URL names
    name: str
    model: str
    job_dir: str
    prepared_at: float
    run_id: str = ""
    state: str = "missing"  # the run's state, or "missing" when the directory is gone
    rounds: int = 0
    accuracy: float | None = None
    error: str = ""


@dataclass(frozen=True)
class JobDetail:
    summary: JobSummary
    rounds: list[dict[str, Any]] = field(default_factory=list)
    privacy: list[dict[str, Any]] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    chart: str = ""  # inline SVG: accuracy against round
    stations: list["StationChange"] = field(default_factory=list)
    produced: list[str] = field(default_factory=list)  # registry models its run produced


@dataclass(frozen=True)
class StationChange:
    """A station's own held-out accuracy before the job (round 0: the starting model) and
    after it (the last round it was evaluated in)."""

    station: str
    before: float | None
    after: float | None
    after_round: int
    examples: int

    @property
    def delta(self) -> float | None:
        return None if self.before is None or self.after is None else self.after - self.before


def station_changes(evaluations: list[dict[str, Any]]) -> list[StationChange]:
    """Per station, from the run store's evaluations (``round``, ``party``, ``accuracy``,
    ``examples``): round 0 against the newest round evaluated."""
    by_party: dict[str, dict[int, dict[str, Any]]] = {}
    for row in evaluations:
        by_party.setdefault(str(row["party"]), {})[int(row["round"])] = row
    changes = []
    for party, rounds in sorted(by_party.items()):
        last = max(rounds)
        before = rounds.get(0, {}).get("accuracy")
        after = rounds[last].get("accuracy") if last > 0 else None
        changes.append(
            StationChange(
                party,
                None if before is None else float(before),
                None if after is None else float(after),
                last,
                int(rounds[last].get("examples") or 0),
            )
        )
    return changes


def accuracy_of(round_row: dict[str, Any]) -> float | None:
    for metrics in (round_row["eval_metrics"], round_row["train_metrics"]):
        for key in ACCURACY_KEYS:
            if key in metrics:
                return float(metrics[key])
    return None


def _open(job_dir: str) -> RunStore | None:
    path = Path(job_dir) / RUNS_DB
    return RunStore(path) if path.is_file() else None


def _summary(job: views_store.FleetJob) -> tuple[JobSummary, RunStore | None]:
    base = JobSummary(str(job.rowid), job.name, job.model, job.job_dir, job.prepared_at)
    store = _open(base.job_dir)
    if store is None:
        return base, None
    runs = store.runs()
    if not runs:
        return base, store
    run = runs[-1]
    rounds = store.rounds(str(run["run_id"]))
    accuracies = [a for a in (accuracy_of(r) for r in rounds) if a is not None]
    summary = JobSummary(
        base.job_id,
        base.name,
        base.model,
        base.job_dir,
        base.prepared_at,
        run_id=str(run["run_id"]),
        state=str(run["state"]),
        rounds=int(run["last_round"]),
        accuracy=accuracies[-1] if accuracies else None,
        error=str(run["error"] or ""),
    )
    return summary, store


def _visible(fleet: Fleet, jobs: list[views_store.FleetJob], viewer: Account | None) -> set[str]:
    """The job directories of ``jobs`` that ``viewer`` may see (None: every one)."""
    dirs = {job.job_dir for job in jobs}
    if viewer is None or viewer.role is Role.ADMIN:
        return dirs
    teams = team_store.teams_of_job_dirs(fleet.store, dirs)
    members: dict[str, set[str]] = {}
    for m in team_store.memberships(fleet.store):
        members.setdefault(m.team, set()).add(m.member)
    return {
        d
        for d in dirs
        if d not in teams or not members.get(teams[d]) or viewer.name in members[teams[d]]
    }


def list_jobs(fleet: Fleet, viewer: Account | None = None) -> list[JobSummary]:
    """The fleet's jobs that ``viewer`` may see (its teams', a console admin: all)."""
    every = views_store.fleet_jobs(fleet.store)
    visible = _visible(fleet, every, viewer)
    jobs = []
    for job in every:
        if job.job_dir not in visible:
            continue
        summary, store = _summary(job)
        if store is not None:
            store.close()
        jobs.append(summary)
    return jobs


def job_detail(fleet: Fleet, job_id: str, viewer: Account | None = None) -> JobDetail:
    job = views_store.fleet_job(fleet.store, int(job_id) if job_id.isdigit() else -1)
    # Another team's job is not found, the same as one that does not exist.
    if job is None or not _visible(fleet, [job], viewer):
        raise ManagerError(f"no job {job_id!r} on this fleet; see the jobs page")
    summary, store = _summary(job)
    if store is None or not summary.run_id:
        return JobDetail(summary)
    try:
        rounds = store.rounds(summary.run_id)
        names = store.party_names(summary.run_id)
        privacy = store.privacy_spent(summary.run_id)
        evaluations = store.evaluations(summary.run_id)
    finally:
        store.close()
    points = [(int(r["round"]), a) for r in rounds if (a := accuracy_of(r)) is not None]
    produced = [m.ref for m in fleet.registry.list() if m.run_id == summary.run_id]
    return JobDetail(
        summary,
        rounds,
        privacy,
        names,
        accuracy_chart(points),
        station_changes(evaluations),
        produced,
    )


def round_ticks(last: int, most: int = 8) -> list[int]:
    """Round numbers to label on the x axis: 1, the last, and evenly between (at most
    ``most``)."""
    if last <= 1:
        return [1]
    step = max(1, -(-(last - 1) // (most - 1)))
    ticks = list(range(1, last, step))
    return [*ticks, last] if ticks[-1] != last else ticks


def accuracy_chart(points: list[tuple[int, float]], width: int = 520, height: int = 200) -> str:
    """Accuracy against round as a small inline SVG (no script, no CDN), with ticks on
    both axes."""
    if not points:
        return ""
    left, pad = 44, 30
    last = max(r for r, _ in points)
    low = min(0.0, min(a for _, a in points))

    def x(r: int) -> float:
        return left + (width - left - pad) * (r - 1) / max(last - 1, 1)

    def y(a: float) -> float:
        return height - pad - (height - 2 * pad) * (a - low) / max(1.0 - low, 1e-9)

    line = " ".join(f"{x(r):.1f},{y(a):.1f}" for r, a in points)
    dots = "".join(
        f'<circle cx="{x(r):.1f}" cy="{y(a):.1f}" r="3"><title>round {r}: {a:.3f}</title></circle>'
        for r, a in points
    )
    ticks = []
    for r in round_ticks(last):
        ticks.append(
            f'<line x1="{x(r):.1f}" y1="{height - pad}" x2="{x(r):.1f}" y2="{height - pad + 4}" '
            f'class="axis"/><text class="tick" x="{x(r):.1f}" y="{height - pad + 15}" '
            f'text-anchor="middle">{r}</text>'
        )
    steps = 4
    for i in range(steps + 1):
        a = low + (1.0 - low) * i / steps
        ticks.append(
            f'<line x1="{left - 4}" y1="{y(a):.1f}" x2="{left}" y2="{y(a):.1f}" class="axis"/>'
            f'<text class="tick" x="{left - 6}" y="{y(a) + 4:.1f}" text-anchor="end">{a:.2f}</text>'
        )
    return (
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="accuracy against round">'
        f'<line x1="{left}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'class="axis"/>'
        f'<line x1="{left}" y1="{pad}" x2="{left}" y2="{height - pad}" class="axis"/>'
        f'<text x="{left}" y="{pad - 10}">accuracy</text>'
        f'<text x="{width - pad}" y="{height - 2}" text-anchor="end">round</text>'
        f'{"".join(ticks)}<polyline points="{line}" fill="none" class="series"/>{dots}</svg>'
    )

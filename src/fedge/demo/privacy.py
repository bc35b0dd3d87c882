"""The demo's privacy chapter: budgets in the signed configs, a DP-SGD job under SecAgg+.

Each station's operator first sets its own privacy floor (the default one, locally, as
`fedge agent privacy-floor` does: DP-SGD only, whatever the manager says); then each gets
a lifetime privacy budget (epsilon 8, delta 1e-5) in its signed edge config, which can
only tighten the floor; its agent writes it into the station's ledger. A short federated
job then trains the fleet's model with DP-SGD on every station (a target epsilon per
station for the job) while the aggregator only ever sees the SecAgg+ masked sum of their
updates. The chapter reports what each station spent, from the job's run store and from
the stations' own telemetry. The job's model is not published: it shows the mechanism,
not a better model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedge.aggregator.jobs.run_store import RunStore
from fedge.demo.learning import config_applied
from fedge.edge_agent.config.privacy_budget import set_local_floor
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.store import Store
from fedge.federation import fleet_job
from fedge.federation.prepare import prepare
from fedge.privacy.floor import default_floor

LIFETIME_EPSILON = 8.0
DELTA = 1e-5  # within the stations' default floor (1 / (10 x 5,000 kept images))
JOB_EPSILON = 4.0
ROUNDS = 2
JOB = """# Written by the demo: DP-SGD on every station, SecAgg+ on the aggregator.
[job]
name = "fleet-private"
rounds = {rounds}
seed = 0

[task]
model = "{model}"
lr = 0.003
local_epochs = 2
batch_size = 16

[strategy]
kind = "fedavg"

[privacy]
mode = "local"          # DP-SGD (Opacus) on every station
epsilon = {epsilon}     # each station's target for this job
delta = {delta}
clipping_norm = 1.0
rounds_per_party = {rounds}
secagg = true           # the aggregator only sees the masked sum
secagg_threshold = 3      # the 3 stations: SecAgg+ never unmasks fewer (issue 24)

[federation]
backend = "fleet"
fleet = "{fleet}"
edges = "all"
node_wait_s = 300.0
round_timeout_s = 600.0
eval_timeout_s = 300.0
"""


@dataclass
class PrivacyChapter:
    """What the chapter measured, for the report."""

    job_dir: Path
    model: str
    job_s: float = 0.0
    # edge -> {"rounds", "epsilon_job", "epsilon_total"} from the run store
    spent: dict[str, dict[str, float]] = field(default_factory=dict)
    # edge -> epsilon the station itself last reported spent (its telemetry)
    reported: dict[str, float | None] = field(default_factory=dict)
    # edge -> round -> accuracy on the station's held-out images
    held_out: dict[str, dict[int, float]] = field(default_factory=dict)


def run_privacy(
    out: Path,
    home: ManagerHome,
    fleet: Fleet,
    store: Store,
    edges: list[str],
    model: str,
    console: Console,
    wait: Any,
) -> PrivacyChapter:
    """The chapter; ``wait(predicate, timeout_s, what)`` is the demo's poller."""
    result = PrivacyChapter(out / "fleet-private", model)
    console.rule("[bold]privacy: station budgets, DP-SGD and secure aggregation")
    # Each station's own floor, as its operator sets it on the station (`fedge agent
    # privacy-floor`): from now on it trains only with DP-SGD, whatever the manager says.
    for edge in edges:
        set_local_floor(out / edge / "agent.toml", default_floor(5000))
    console.print(
        "every station's operator set its own privacy floor (DP-SGD only, epsilon <= "
        f"{default_floor(5000).job_epsilon:g} per job); the manager can only tighten it"
    )
    for pushed in fleet.set_privacy(edges, LIFETIME_EPSILON, DELTA):
        wait(lambda p=pushed: config_applied(store, p), 30, f"privacy budget on {pushed.edge}")
    console.print(
        f"every station's signed config now bounds its lifetime privacy spend at epsilon "
        f"{LIFETIME_EPSILON:g} (delta {DELTA:g}); each agent wrote it into its own ledger"
    )
    manifest = out / "fleet-private.toml"
    manifest.write_text(
        JOB.format(rounds=ROUNDS, model=model, epsilon=JOB_EPSILON, delta=DELTA, fleet=fleet.fleet),
        encoding="utf-8",
    )
    started = time.monotonic()
    prepare(manifest, result.job_dir, home)
    fleet_job.submit_to_fleet(result.job_dir, home)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("DP-SGD + SecAgg+ job on the SuperLink", total=ROUNDS)

        def show(done: int, total: int, accuracy: float | None) -> None:
            progress.update(task, completed=done, total=total)

        ended = fleet_job.wait(result.job_dir, progress=show, timeout_s=1800)
    if ended.state.value != "completed":
        raise RuntimeError(f"demo: the private job ended {ended.state.value}: {ended.error}")
    result.job_s = time.monotonic() - started
    _read_run_store(result)
    wait(
        lambda: all(fleet.show(e).privacy_epsilon_spent is not None for e in result.spent),
        60,
        "the stations' reports of the epsilon they spent",
    )
    result.reported = {e: fleet.show(e).privacy_epsilon_spent for e in edges}
    _print(result, console)
    return result


def _read_run_store(result: PrivacyChapter) -> None:
    store = RunStore(result.job_dir / "runs.db")
    try:
        run_id = str(store.runs()[-1]["run_id"])
        for row in store.privacy_spent(run_id):
            result.spent[str(row["name"])] = {
                "rounds": float(row["rounds"]),
                "epsilon_job": float(row["epsilon_job"]),
                "epsilon_total": float(row["epsilon_total"]),
            }
        for row in store.evaluations(run_id):
            if row["accuracy"] is not None:
                by_round = result.held_out.setdefault(str(row["party"]), {})
                by_round[int(row["round"])] = float(row["accuracy"])
    finally:
        store.close()


def _print(result: PrivacyChapter, console: Console) -> None:
    table = Table(
        "station", "DP rounds", "eps (this job)", "eps (lifetime)", "reported", "held-out",
        title=f"privacy spent (job target {JOB_EPSILON:g}, lifetime bound {LIFETIME_EPSILON:g})",
    )  # fmt: skip
    for edge, spent in sorted(result.spent.items()):
        reported = result.reported.get(edge)
        rounds = result.held_out.get(edge, {})
        accuracy = f"{rounds[max(rounds)]:.3f}" if rounds else "-"
        table.add_row(
            edge, f"{spent['rounds']:.0f}", f"{spent['epsilon_job']:.3f}",
            f"{spent['epsilon_total']:.3f}", "-" if reported is None else f"{reported:.3f}",
            accuracy,
        )  # fmt: skip
    console.print(table)


def report_lines(result: PrivacyChapter) -> list[str]:
    """The chapter's Markdown section."""
    lines = [
        "## Privacy",
        "",
        f"Every station's signed config bounds its lifetime privacy spend at epsilon "
        f"{LIFETIME_EPSILON:g} (delta {DELTA:g}); its agent keeps the bound in the station's "
        f"own ledger. A {ROUNDS}-round job then trained {result.model} with DP-SGD (Opacus) "
        f"on every station, a target of epsilon {JOB_EPSILON:g} per station for the job, "
        "under SecAgg+: the aggregator only saw the masked sum of the stations' updates. "
        f"It took {result.job_s:.0f} s; its model is not published.",
        "",
        "| station | DP rounds | epsilon, this job | epsilon, lifetime | reported by the station "
        "| held-out accuracy, before → after |",
        "|---|---|---|---|---|---|",
    ]
    for edge, spent in sorted(result.spent.items()):
        reported = result.reported.get(edge)
        rounds = result.held_out.get(edge, {})
        change = (
            f"{rounds[min(rounds)]:.3f} → {rounds[max(rounds)]:.3f}" if len(rounds) > 1 else "-"
        )
        lines.append(
            f"| {edge} | {spent['rounds']:.0f} | {spent['epsilon_job']:.3f} | "
            f"{spent['epsilon_total']:.3f} | {'-' if reported is None else f'{reported:.3f}'} "
            f"| {change} |"
        )
    return [*lines, ""]


def summary(result: PrivacyChapter) -> dict[str, Any]:
    return {
        "job_dir": str(result.job_dir),
        "model": result.model,
        "job_s": result.job_s,
        # Each station's bounds: the tighter of its own floor and what the manager set.
        "lifetime_epsilon": min(LIFETIME_EPSILON, default_floor(5000).lifetime_epsilon),
        "job_epsilon": min(JOB_EPSILON, default_floor(5000).job_epsilon),
        "spent": result.spent,
        "reported": result.reported,
        "held_out": {e: {str(r): a for r, a in v.items()} for e, v in result.held_out.items()},
    }

"""``fedge manager prune``: the manager's retention (manager.toml ``keep_*_days``) now."""

import math
import time
from typing import Annotated

import typer

from fedge.cli.common import DEFAULT_HOME, HomeOption, console, friendly_errors, print_json
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.retention.policy import (
    DAY_S,
    HISTORY_TABLES,
    RECORD_TABLES,
    Pruner,
    RetentionPolicy,
    due,
    totals,
)
from fedge.edge_manager.store import Store


def _limits(policy: RetentionPolicy) -> dict[str, float]:
    limits = {table: policy.records_s(table) for table in RECORD_TABLES}
    limits["batches"] = policy.batches_s
    limits.update(dict.fromkeys((*HISTORY_TABLES, "desired"), policy.history_s))
    return limits


@friendly_errors
def prune(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only count the rows past their limit.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Delete what is older than manager.toml's retention (``serve`` does it every minute).

    Example: fedge manager prune --dry-run
    """
    manager_home = ManagerHome(home)
    policy = RetentionPolicy.from_settings(manager_home.settings())
    store = Store(manager_home.db_path)
    try:
        now = time.time()
        counts = due(store, policy, now) if dry_run else Pruner(policy).run_until_done(store, now)
        so_far = totals(store)
    finally:
        store.close()
    limits = _limits(policy)
    kinds = [*limits, "evaluations"]  # the gate's items are kept by count, not age
    if as_json:
        print_json(
            {
                "dry_run": dry_run,
                "limit_days": {k: None if math.isinf(v) else v / DAY_S for k, v in limits.items()},
                "keep_gates_per_model": policy.gates_per_model,
                "due" if dry_run else "pruned": {k: int(counts.get(k, 0)) for k in kinds},
                "pruned_so_far": {k: so_far.get(k, 0) for k in kinds},
            }
        )
        return
    header = "past limit" if dry_run else "pruned now"
    console.print(f"{'kind':<14} {'keep':>10} {header:>11} {'pruned so far':>14}")
    keeps = {k: "forever" if math.isinf(v) else f"{v / DAY_S:g} days" for k, v in limits.items()}
    keeps["evaluations"] = f"{policy.gates_per_model} gates"  # per model; served: all
    for kind, keep in keeps.items():
        console.print(
            f"{kind:<14} {keep:>10} {int(counts.get(kind, 0)):>11} {so_far.get(kind, 0):>14}",
            highlight=False,
        )

"""The chaos run's JSON result: the issue's figures first, then the detail behind them."""

from collections import Counter
from pathlib import Path
from typing import Any

from fedge.bench.chaos.injector import Injector, Watchdog
from fedge.bench.chaos.invariants import Verdict
from fedge.bench.chaos.load import OperatorLoad, StationLoad

TARGET_FAULTS_PER_MINUTE = 8  # issue 9: >= 40 faults in a 5-minute run
TARGET_KINDS = 6


def build_report(
    *,
    machine: dict[str, Any],
    seed: int,
    agents: int,
    minutes: float,
    disk_agents: int,
    verdict: Verdict,
    injector: Injector,
    loads: dict[str, StationLoad],
    operator: OperatorLoad,
    watchdog: Watchdog,
    heal_s: float,
    pending: list[str],
    unexpected_exits: list[str],
    stop_timeouts: list[str],
    workdir: Path | None,
) -> dict[str, Any]:
    applied = [a for a in injector.applied if a.counts]
    by_kind = Counter(a.fault.kind.value for a in applied)
    load_counters: Counter[str] = Counter()
    for load in loads.values():
        load_counters.update(load.counters)
    hung = verdict.hung_processes + len(stop_timeouts)
    # A hang the watchdog saw mid-run fails the run too, even if the agent recovered by
    # the end: a station that stops answering for 10 s is a hang a plant would see.
    hang_incidents = len(watchdog.incidents)
    faults_target = round(TARGET_FAULTS_PER_MINUTE * minutes)
    met = (
        verdict.passed
        and hang_incidents == 0
        and not stop_timeouts
        and not unexpected_exits
        and len(applied) >= faults_target
        and len(by_kind) >= TARGET_KINDS
    )
    return {
        "benchmark": "chaos",
        "machine": machine,
        "seed": seed,
        "agents": agents,
        "minutes": minutes,
        "disk_agents": disk_agents,
        "faults_injected": len(applied),
        "fault_kinds": len(by_kind),
        "faults_by_kind": dict(sorted(by_kind.items())),
        "records_produced": verdict.records_produced,
        "records_stored": verdict.records_stored,
        "lost": verdict.lost,
        "duplicated": verdict.duplicated,
        "hung_processes": hung,
        "hang_incidents": hang_incidents,
        "unconverged_edges": verdict.unconverged_edges,
        "open_gaps": verdict.open_gaps,
        "counter_issues": list(verdict.counter_issues),
        "unexpected_exits": unexpected_exits,
        "stop_timeouts": stop_timeouts,
        "heal_s": round(heal_s, 1),
        "heal_pending": pending,
        "watchdog": {"polls": watchdog.polls, "incidents": watchdog.incidents},
        "load": dict(sorted(load_counters.items())),
        "operator": {**operator.counters, "errors_seen": operator.errors[:5]},
        "details": dict(verdict.details),
        "faults": [a.as_dict() for a in injector.applied],
        "target": {
            "faults_injected": faults_target,
            "fault_kinds": TARGET_KINDS,
            "lost": 0,
            "duplicated": 0,
            "hung_processes": 0,
            "hang_incidents": 0,
            "unconverged_edges": 0,
        },
        "met_target": met,
        "workdir": None if workdir is None else str(workdir),
    }

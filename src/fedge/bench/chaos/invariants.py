"""The chaos run's end check: pure functions over what was observed after the heal phase.

The runner gathers one :class:`EdgeObservation` per edge (from the agent's own SQLite
file, its ``/v1/status``, what the load driver was acknowledged, and the manager's
store) and a :class:`ControlObservation`; :func:`check` decides. Nothing here touches a
process or a file, so each invariant is tested with literal values.

Invariants (issue 9):

- every record an agent made durable (its ``predictions`` and ``labels`` tables) is
  stored at the manager exactly once; every prediction and label the local API
  acknowledged is in the agent's file; every image dropped into the inbox was scored
  exactly once;
- no gap left open in any (edge, stream) sequence;
- every edge applies the last desired config version and serves the last desired model,
  as the agent says and as the manager recorded;
- every process alive and answering (agents' ``/v1/status``, ``manager serve``, broker);
- counters agree: empty outboxes, the manager's batch record counts equal its rows, no
  rejected messages, no restore failure on an edge whose model was never damaged.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EdgeObservation:
    edge: str
    produced_predictions: frozenset[str]  # ids in the agent's predictions table
    produced_labels: frozenset[str]  # ids in the agent's labels table
    acked_predictions: frozenset[str]  # ids the local API returned
    acked_labels: frozenset[str]
    dropped_files: frozenset[str]  # inbox file names the camera delivered
    scored_sources: Mapping[str, int]  # source -> predictions of it, on the agent
    stored_predictions: Mapping[str, int]  # id -> rows at the manager
    stored_labels: frozenset[str]
    open_gaps: int
    desired_config: int
    agent_config: int | None  # None: the agent did not answer
    manager_config: int
    desired_model: str
    agent_serving: str | None
    manager_serving: str
    responsive: bool
    backlog: Mapping[str, int] | None
    batch_records: int  # sum of n_records over the manager's prediction and label batches
    stored_rows: int  # prediction rows + edge label rows at the manager
    restore_failures: int  # deploy events reporting restore_failed
    corruptions: int  # model_corrupt faults injected on this edge


@dataclass(frozen=True)
class ControlObservation:
    manager_responsive: bool
    broker_running: bool
    rejections: int


@dataclass(frozen=True)
class Verdict:
    records_produced: int
    records_stored: int
    lost: int
    duplicated: int
    hung_processes: int
    unconverged_edges: int
    open_gaps: int
    counter_issues: tuple[str, ...]
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not (
            self.lost
            or self.duplicated
            or self.hung_processes
            or self.unconverged_edges
            or self.open_gaps
            or self.counter_issues
        )


def _file_source(name: str) -> str:
    return f"file:{name}"


def _edge_findings(obs: EdgeObservation) -> dict[str, Any]:
    stored_ids = set(obs.stored_predictions)
    missing_predictions = sorted(obs.produced_predictions - stored_ids)
    missing_labels = sorted(obs.produced_labels - obs.stored_labels)
    acked_not_kept = sorted(
        (obs.acked_predictions - obs.produced_predictions)
        | (obs.acked_labels - obs.produced_labels)
    )
    unscored = sorted(n for n in obs.dropped_files if not obs.scored_sources.get(_file_source(n)))
    duplicated_ids = {i: n for i, n in obs.stored_predictions.items() if n > 1}
    rescored = {s: n for s, n in obs.scored_sources.items() if n > 1}
    unconverged = []
    if obs.agent_config != obs.desired_config or obs.manager_config != obs.desired_config:
        unconverged.append(
            f"config desired v{obs.desired_config}, agent v{obs.agent_config}, "
            f"manager recorded v{obs.manager_config}"
        )
    if obs.agent_serving != obs.desired_model or obs.manager_serving != obs.desired_model:
        unconverged.append(
            f"model desired {obs.desired_model!r}, agent serves {obs.agent_serving!r}, "
            f"manager recorded {obs.manager_serving!r}"
        )
    issues = []
    if obs.backlog is not None and any(obs.backlog.values()):
        issues.append(f"{obs.edge}: backlog left {dict(obs.backlog)}")
    if obs.batch_records != obs.stored_rows:
        issues.append(
            f"{obs.edge}: manager batches hold {obs.batch_records} records, "
            f"{obs.stored_rows} rows stored"
        )
    if obs.restore_failures and not obs.corruptions:
        issues.append(f"{obs.edge}: {obs.restore_failures} restore failure(s), no damage injected")
    return {
        "lost": len(missing_predictions)
        + len(missing_labels)
        + len(acked_not_kept)
        + len(unscored),
        "duplicated": sum(n - 1 for n in duplicated_ids.values())
        + sum(n - 1 for n in rescored.values()),
        "missing_predictions": missing_predictions[:20],
        "missing_labels": missing_labels[:20],
        "acked_not_kept": acked_not_kept[:20],
        "inbox_unscored": unscored[:20],
        "duplicated_ids": dict(list(duplicated_ids.items())[:20]),
        "rescored_sources": dict(list(rescored.items())[:20]),
        "unconverged": unconverged,
        "hung": not obs.responsive,
        "issues": issues,
        "produced": len(obs.produced_predictions) + len(obs.produced_labels),
        "stored": sum(obs.stored_predictions.values()) + len(obs.stored_labels),
    }


def check(edges: list[EdgeObservation], control: ControlObservation) -> Verdict:
    findings = {obs.edge: _edge_findings(obs) for obs in edges}
    issues = [issue for f in findings.values() for issue in f["issues"]]
    if control.rejections:
        issues.append(f"manager rejected {control.rejections} message(s)")
    hung = sum(1 for f in findings.values() if f["hung"])
    hung += (not control.manager_responsive) + (not control.broker_running)
    details = {
        edge: {k: v for k, v in f.items() if v and k not in ("issues", "produced", "stored")}
        for edge, f in findings.items()
    }
    return Verdict(
        records_produced=sum(f["produced"] for f in findings.values()),
        records_stored=sum(f["stored"] for f in findings.values()),
        lost=sum(f["lost"] for f in findings.values()),
        duplicated=sum(f["duplicated"] for f in findings.values()),
        hung_processes=hung,
        unconverged_edges=sum(1 for f in findings.values() if f["unconverged"]),
        open_gaps=sum(obs.open_gaps for obs in edges),
        counter_issues=tuple(issues),
        details={edge: d for edge, d in details.items() if d},
    )

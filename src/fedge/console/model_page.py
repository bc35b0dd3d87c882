"""A page per model version (issue 30, item 5): its lineage, the gate's verdict as a table
per station with the policy in words, where it serves, and where it was rolled back.

Read through the library: the registry (``Registry.list``), the gate's stored verdict
(``gating.stored``), the rollouts of the model (incident_store.py) and the fleet's jobs
(jobs.py: the job whose run produced it).
"""

from dataclasses import dataclass, field
from typing import Any

from fedge.console import incident_store, jobs
from fedge.console.accounts import Account
from fedge.console.conditions import readable
from fedge.console.registry_views import ModelRow, models_page
from fedge.edge_manager.errors import ManagerError, UnknownModelError
from fedge.edge_manager.fleet.operations import Fleet


def policy_words(policy: dict[str, Any]) -> list[str]:
    """The gate's policy (GatePolicy, as stored with its verdict) in sentences."""
    words = []
    if "max_station_drop" in policy:
        words.append(
            "A station fails when the candidate's accuracy on its held-out images is below "
            f"its serving model's by more than {float(policy['max_station_drop']):g}."
        )
    if "min_overall_gain" in policy:
        gain = float(policy["min_overall_gain"])
        words.append(
            "Over every usable station together, the candidate must be "
            + (
                "strictly better than the serving models."
                if gain == 0
                else f"better by at least {gain:g}."
            )
        )
    if "min_examples" in policy:
        words.append(
            f"A station is used only with at least {int(policy['min_examples'])} labelled "
            "held-out images; the others are listed, not counted."
        )
    if "target_recall" in policy:
        words.append(
            f"Recommended thresholds catch {float(policy['target_recall']):.0%} of each "
            "defect class's held-out images."
        )
    return words


@dataclass(frozen=True)
class RolloutOfModel:
    rollout_id: str
    state: str  # in words
    finished_at: float | None
    updated_at: float
    reason: str
    rolled_back: list[str] = field(default_factory=list)  # edges sent back off it
    moved: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ModelPage:
    model: ModelRow
    ancestors: list[ModelRow]  # the parent first, then its parent...
    children: list[ModelRow]
    verdict: dict[str, Any] | None  # the gate's evidence (stations, overall, policy...)
    policy: list[str]
    serving: list[str]  # edges serving it now
    rollouts: list[RolloutOfModel]
    job: jobs.JobSummary | None  # the fleet job whose run produced it


def model_page(
    fleet: Fleet, name: str, version_text: str, viewer: Account | None = None
) -> ModelPage:
    """Raises UnknownModelError (a ManagerError) for a version the registry lacks, or one
    of another closed team's (not found, the same as one that does not exist)."""
    if not version_text.isdigit():
        raise ManagerError(f"{version_text!r} is not a model version; see the models page")
    version = int(version_text)
    rows = {(m.name, m.version): m for m in models_page(fleet, viewer).models}
    model = rows.get((name, version))
    if model is None:
        raise UnknownModelError(
            f"model {name}:{version} is not in the registry; see the models page"
        )
    ancestors: list[ModelRow] = []
    parent = model.parent
    while parent is not None and (name, parent) in rows and len(ancestors) < 100:
        ancestors.append(rows[(name, parent)])
        parent = rows[(name, parent)].parent
    children = sorted(
        (m for m in rows.values() if m.name == name and m.parent == version),
        key=lambda m: m.version,
    )
    evidence = None if model.verdict is None else dict(model.verdict.evidence)
    policy = policy_words(dict((evidence or {}).get("policy") or {}))
    by_rollout: dict[str, RolloutOfModel] = {}
    for part in incident_store.rollouts_of_model(fleet.store, name, version):
        entry = by_rollout.setdefault(
            part.rollout_id,
            RolloutOfModel(
                part.rollout_id, readable(part.rollout_state), part.finished_at, part.updated_at,
                part.reason,
            ),
        )  # fmt: skip
        if part.edge_state in {"rolling_back", "rolled_back", "unconfirmed"}:
            entry.rolled_back.append(part.edge)
        if part.moved_at is not None:
            entry.moved.append(part.edge)
    for rollout in by_rollout.values():  # stations that rolled it back on their own
        for edge in rollout.moved:
            for rollout_id, _, _ in incident_store.degraded_by(fleet.store, edge):
                if rollout_id == rollout.rollout_id and edge not in rollout.rolled_back:
                    rollout.rolled_back.append(edge)
    job = None
    if model.run_id:
        job = next((j for j in jobs.list_jobs(fleet, viewer) if j.run_id == model.run_id), None)
    return ModelPage(
        model,
        ancestors,
        children,
        evidence,
        policy,
        incident_store.edges_serving(fleet.store, model.ref),
        list(by_rollout.values()),
        job,
    )

"""The models and rollouts pages: the registry with its lineage and the gate's evidence,
and staged rollouts with their waves, health and events -- read through the library
(``Registry.list``, ``gating.stored``, ``rollout_views``), as the CLI reads them.
"""

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fedge.console import incidents, views_store
from fedge.console.accounts import Account, Role
from fedge.console.conditions import readable
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.gate import run as gating
from fedge.edge_manager.rollout import views as rollout_views
from fedge.edge_manager.rollout.machine import MOVING, EdgeState, RolloutState
from fedge.edge_manager.scheduler import owned_models

# No further wave moves in these (an aborted one only waits for edges to come back).
STOPPED = frozenset({"completed", "degraded", "aborted", "rolled_back"})


@dataclass(frozen=True)
class ModelRow:
    name: str
    version: int
    parent: int | None
    run_id: str
    created_at: float
    sha256: str
    size: int
    classes: str
    verdict: gating.StoredVerdict | None  # the gate's newest, if it judged this version
    serving: int  # edges serving it now
    team: str = ""  # the team that owns it ('': none, everyone's)

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"


@dataclass(frozen=True)
class LineageNode:
    model: ModelRow
    children: "tuple[LineageNode, ...]"


@dataclass(frozen=True)
class ModelsPage:
    models: list[ModelRow]
    lineage: dict[str, list[LineageNode]]  # model name -> its root versions


def models_page(fleet: Fleet, viewer: Account | None = None) -> ModelsPage:
    """The registry as ``viewer`` may see it: another closed team's versions are left out
    (owned_models.py; None, or a console admin: every version)."""
    owners = owned_models.owners(fleet.store)
    hidden = (
        frozenset()
        if viewer is None
        else owned_models.hidden(fleet.store, viewer.name, admin=viewer.role is Role.ADMIN)
    )
    serving: dict[str, int] = defaultdict(int)
    for ref in views_store.serving_refs(fleet.store):
        serving[ref] += 1
    rows = [
        ModelRow(
            name=r.name,
            version=r.version,
            parent=r.parent_version,
            run_id=r.run_id or "",
            created_at=r.created_at,
            sha256=r.sha256,
            size=r.size,
            classes=",".join(r.classes),
            verdict=gating.stored(fleet.store, r.name, r.version),
            serving=serving.get(r.ref, 0),
            team=owners.get((r.name, r.version), ""),
        )
        for r in fleet.registry.list()
        if (r.name, r.version) not in hidden
    ]
    return ModelsPage(sorted(rows, key=lambda m: (m.name, -m.version)), _lineage(rows))


def _lineage(rows: list[ModelRow]) -> dict[str, list[LineageNode]]:
    """Each model name's versions as a tree: a version under the one it was trained from
    (``Lineage.parent_version``); a version whose parent is not in the registry is a root."""
    by_key = {(m.name, m.version): m for m in rows}
    children: dict[tuple[str, int], list[ModelRow]] = defaultdict(list)
    roots: dict[str, list[ModelRow]] = defaultdict(list)
    for model in rows:
        if model.parent is not None and (model.name, model.parent) in by_key:
            children[(model.name, model.parent)].append(model)
        else:
            roots[model.name].append(model)

    def node(model: ModelRow) -> LineageNode:
        kids = sorted(children[(model.name, model.version)], key=lambda m: m.version)
        return LineageNode(model, tuple(node(k) for k in kids))

    return {
        name: [node(m) for m in sorted(models, key=lambda m: m.version)]
        for name, models in sorted(roots.items())
    }


def rollouts_page(fleet: Fleet) -> list[rollout_views.RolloutListing]:
    return rollout_views.list_rollouts(fleet.store)


def rollout_actions(state: str) -> tuple[str, ...]:
    """What an operator may do to a rollout in ``state`` (the machine's own rules:
    machine.pause, resume, abort); the page offers nothing else."""
    if state in {s.value for s in MOVING}:
        return ("pause", "abort")
    if state == RolloutState.PAUSED.value:
        return ("resume", "abort")
    if state == RolloutState.DEGRADED.value:
        return ("abort",)
    return ()


def edge_shown_state(edge_state: str, rollout_finished: bool) -> str:
    """An edge's state in a rollout, in words; an edge whose wave never came in a rollout
    that ended is not "waiting" (it never will be)."""
    if edge_state == EdgeState.WAITING.value and rollout_finished:
        return "not moved (the rollout ended first)"
    return readable(edge_state)


def rollout_page(fleet: Fleet, rollout_id: str) -> dict[str, Any]:
    """Raises RolloutError (a ManagerError) for an unknown rollout."""
    status = rollout_views.status(fleet.store, rollout_id)
    finished = status["finished_at"] is not None or status["state"] in STOPPED
    waves: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for edge in status["edges"]:
        edge["shown_state"] = edge_shown_state(edge["state"], finished)
        waves[int(edge["wave"])].append(edge)
    status["waves"] = [
        {
            "wave": wave,
            "name": "canary" if wave == 0 else f"wave {wave}",
            "edges": edges,
            "moved": sum(1 for e in edges if e["state"] != "waiting"),
            "settled": sum(1 for e in edges if e["settled_at"] is not None),
        }
        for wave, edges in sorted(waves.items())
    ]
    status["shown_label"] = readable(status["label"])
    status["incident"] = incidents.rollout_incident(fleet, status)
    status["actions"] = rollout_actions(status["state"])
    return status

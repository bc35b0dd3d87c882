"""The console pages' reads over the manager's store that the Fleet library does not offer.

A config by version and its history (queries.py), the fleet's jobs (jobs.py), an edge's
recent scores and deployment events (histograms.py), which models the edges serve
(registry_views.py) and each model's positive classes. Read-only; what a page makes of
the values stays in the page's module.
"""

import json
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager.desired.store import CONFIG
from fedge.edge_manager.registry import store as model_store
from fedge.edge_manager.store import Store


@dataclass(frozen=True)
class ConfigDocument:
    """A desired config of an edge, as stored (its document still encoded)."""

    version: int
    document: str
    created_at: float
    published_at: float | None


@dataclass(frozen=True)
class FleetJob:
    """A federated job prepared against this fleet (``fleet_jobs``)."""

    rowid: int  # its position in fleet_jobs, what the jobs pages' URLs name
    job_dir: str
    name: str
    model: str
    prepared_at: float


@dataclass(frozen=True)
class ScoredPrediction:
    """A prediction's model, scores (a JSON object: class -> score) and decision."""

    model: str
    scores: str
    decision: str
    threshold: float
    at: float


def positive_classes(store: Store) -> dict[str, set[str]]:
    """Each registered model version ('name:version') -> its positive (defect) classes."""
    return {
        f"{m.name}:{m.version}": set(json.loads(m.manifest)["positive_classes"])
        for m in model_store.manifests(store)
    }


def config_document(store: Store, edge: str, version: int) -> str | None:
    """``edge``'s desired config document of ``version`` (None: not in the store)."""
    row = store.one(
        "SELECT document FROM desired WHERE edge=? AND kind=? AND version=?",
        (edge, CONFIG, version),
    )
    return None if row is None else str(row["document"])


def config_documents(store: Store, edge: str, limit: int) -> list[ConfigDocument]:
    """``edge``'s newest ``limit`` desired configs, newest first."""
    rows = store.query(
        "SELECT version, document, created_at, published_at FROM desired "
        "WHERE edge=? AND kind=? ORDER BY version DESC LIMIT ?",
        (edge, CONFIG, limit),
    )
    return [
        ConfigDocument(
            int(row["version"]),
            str(row["document"]),
            float(row["created_at"]),
            None if row["published_at"] is None else float(row["published_at"]),
        )
        for row in rows
    ]


def _job(row: dict[str, Any]) -> FleetJob:
    return FleetJob(
        int(row["rowid"]),
        str(row["job_dir"]),
        str(row["name"]),
        str(row["model"]),
        float(row["prepared_at"]),
    )


def fleet_jobs(store: Store) -> list[FleetJob]:
    """Every job prepared against this fleet, the newest first."""
    rows = store.query(
        "SELECT rowid, job_dir, name, model, prepared_at FROM fleet_jobs ORDER BY prepared_at DESC"
    )
    return [_job(row) for row in rows]


def fleet_job(store: Store, rowid: int) -> FleetJob | None:
    row = store.one(
        "SELECT rowid, job_dir, name, model, prepared_at FROM fleet_jobs WHERE rowid=?",
        (rowid,),
    )
    return None if row is None else _job(row)


def recent_scores(store: Store, edge: str, limit: int) -> list[ScoredPrediction]:
    """``edge``'s newest ``limit`` predictions, newest first."""
    return [
        ScoredPrediction(str(model), str(scores), str(decision), float(threshold), float(at))
        for model, scores, decision, threshold, at in store.conn.execute(
            "SELECT model, scores, decision, threshold, at FROM predictions WHERE edge=? "
            "ORDER BY at DESC LIMIT ?",
            (edge, limit),
        )
    ]


def deploy_events(store: Store, edge: str, limit: int) -> list[dict[str, Any]]:
    """``edge``'s newest ``limit`` deployment events, newest first, as the edge page's
    template reads them (by key)."""
    return store.query(
        "SELECT deployment_id, stage, reason, serving, at FROM deploy_events WHERE edge=? "
        "ORDER BY at DESC LIMIT ?",
        (edge, limit),
    )


def serving_refs(store: Store) -> list[str]:
    """The model each edge serves (one entry an edge; edges serving none are left out)."""
    return [str(r["serving"]) for r in store.query("SELECT serving FROM edges WHERE serving != ''")]


def serving_of(store: Store, edge: str) -> str:
    """The model ``edge`` last reported serving ('' : none, or not enrolled)."""
    row = store.one("SELECT serving FROM edges WHERE edge=?", (edge,))
    return "" if row is None else str(row["serving"])

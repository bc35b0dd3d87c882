"""What the pages show, read through the Fleet library; formatted once for HTML and SSE.

A fleet row is turned into display cells here, and both the template and the live
update stream send those same cells, so a value on an open page never differs from the
same value after a reload.
"""

import time
from dataclasses import dataclass

from fedge.console import freshness, views_store
from fedge.console.deciding import Deciding, deciding
from fedge.console.freshness import Pending
from fedge.console.queries import ConfigVersion, config_at, config_history
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.edge_view_store import Gap
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.fleet.predictions import PredictionFilter, PredictionView, list_predictions
from fedge.edge_manager.fleet.views import EdgeView
from fedge.edge_manager.ingest import thumbnail_store
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import ModelManifest

RECENT_PREDICTIONS = 20


when = freshness.when  # local time with its zone; the templates' filter


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


@dataclass(frozen=True)
class EdgeFigures:
    """What a fleet row shows of an edge: taken from its ``EdgeView`` (``Fleet.show``) on
    its own page, built from grouped queries over all edges for the fleet table
    (fleet_table.py); either way :func:`cells` formats it."""

    edge: str
    state: str
    serving: str  # a model reference, '' when it serves none
    last_seen: float | None
    config_applied: int
    desired_config_version: int
    in_sync: bool
    predictions: int
    rejects: int
    gaps: tuple[Gap, ...]
    label_agreement: float | None
    pending: Pending | None = None  # the newest desired config, when not applied

    @classmethod
    def of(cls, view: EdgeView, pending: Pending | None = None) -> "EdgeFigures":
        return cls(
            edge=view.edge,
            state=view.state,
            serving=view.serving,
            last_seen=view.last_seen,
            config_applied=view.config_applied,
            desired_config_version=view.desired_config_version,
            in_sync=view.in_sync,
            predictions=view.predictions,
            rejects=view.rejects,
            gaps=view.gaps,
            label_agreement=view.label_agreement,
            pending=pending,
        )


@dataclass(frozen=True)
class FleetRow:
    edge: str
    state: str  # as shown: the stored state aged against now (freshness.py)
    in_sync: bool
    cells: dict[str, str]  # field -> text, the same on the page and in live updates
    deciding: Deciding | None = None  # the thresholds the station decides with

    @property
    def revoked(self) -> bool:
        return self.state == "revoked"


@dataclass(frozen=True)
class EdgeDetail:
    row: FleetRow
    view: EdgeView  # Fleet.show's
    desired: EdgeConfig | None
    history: list[ConfigVersion]
    predictions: list[PredictionView]
    thumbnails: frozenset[str]  # the predictions above whose image the station shared
    images: str  # what the station's config says of its images
    classes: tuple[str, ...] = ()  # the serving model's classes (per-class thresholds)


def images(config: EdgeConfig | None) -> str:
    policy = None if config is None else config.thumbnails
    if policy is None:
        return "stay on the station (no thumbnails shared)"
    which = "rejected" if policy.rejects_only else "all scored"
    return f"thumbnails of {which} images shared, {policy.size} px, at most {policy.per_minute}/min"


def cells(
    edge: EdgeFigures, in_force: EdgeConfig | None, decides: Deciding | None, now: float
) -> dict[str, str]:
    """One edge's display cells from its figures, the config it applied (None: unknown)
    and the thresholds that decide on it (None: unknown); its state aged against ``now``."""
    predictions = edge.predictions
    gaps = edge.gaps
    missing = sum(g.to_seq - g.from_seq + 1 for g in gaps)
    interval = (
        freshness.DEFAULT_REPORT_INTERVAL_S if in_force is None else in_force.report_interval_s
    )
    state = freshness.shown_state(edge.state, edge.last_seen, now, interval)
    revoked = edge.state == "revoked"
    # Before its first report an edge decides with the agent's defaults (or its model's
    # recommendation): deciding.py says so, so it does not read as a config it applied.
    threshold = "?" if decides is None else decides.text()
    return {
        "state": state,
        "serving": edge.serving or "-",
        "config": "-" if revoked else f"v{edge.desired_config_version} / v{edge.config_applied}",
        "sync": freshness.sync_text(edge.in_sync, state, edge.last_seen, edge.pending, revoked),
        "threshold": threshold,
        "last_seen": when(edge.last_seen),
        # What the page's clock turns into "13 min ago" (live.js), every second.
        "last_seen_at": "" if edge.last_seen is None else f"{edge.last_seen:.3f}",
        "predictions": str(predictions),
        "reject_rate": percent(edge.rejects / predictions if predictions else None),
        "agreement": percent(edge.label_agreement),
        "gaps": f"{len(gaps)} ({missing} batch{'' if missing == 1 else 'es'})" if gaps else "none",
    }


def table_row(
    edge: EdgeFigures,
    in_force: EdgeConfig | None,
    manifest: ModelManifest | None = None,
    now: float | None = None,
) -> FleetRow:
    """The fleet table's row of ``edge``, and the head of its own page (``manifest``: the
    model it serves, None when it serves none or the registry does not hold it)."""
    now = time.time() if now is None else now
    # No config applied yet: the agent decides as with no config (deciding.py).
    config = None if edge.config_applied == 0 else in_force
    decides = None if in_force is None else deciding(config, manifest)
    shown = cells(edge, in_force, decides, now)
    return FleetRow(edge.edge, shown["state"], edge.in_sync, shown, decides)


def manifest_of(fleet: Fleet, model_ref: str) -> ModelManifest | None:
    """The registry's manifest of ``model_ref`` ('name:version'); None when it has none."""
    name, _, version = model_ref.rpartition(":")
    if not version.isdigit():
        return None
    try:
        return fleet.registry.get(name, int(version)).manifest
    except ManagerError:
        return None


def pending_of(fleet: Fleet, view: EdgeView) -> Pending | None:
    """``view``'s newest desired config when the edge has not applied it."""
    if view.in_sync or view.desired_config_version == 0:
        return None
    newest = views_store.config_documents(fleet.store, view.edge, 1)
    if not newest:
        return None
    return freshness.pending(
        newest[0].version,
        newest[0].created_at,
        newest[0].published_at,
        view.config_status,
        view.config_reason,
    )


def fleet_row(fleet: Fleet, view: EdgeView, now: float | None = None) -> FleetRow:
    """One edge's row from its own view (fleet_table.py builds a whole fleet's at once)."""
    in_force = config_at(fleet, view.edge, view.config_applied)
    figures = EdgeFigures.of(view, pending_of(fleet, view))
    return table_row(figures, in_force, manifest_of(fleet, view.serving), now)


def edge_detail(fleet: Fleet, edge: str) -> EdgeDetail:
    """Raises UnknownEdgeError (a ManagerError) for an edge that is not enrolled."""
    view = fleet.show(edge)
    manifest = manifest_of(fleet, view.serving)
    recent = list_predictions(fleet.store, PredictionFilter(edge=edge, limit=RECENT_PREDICTIONS))
    shared = thumbnail_store.available(fleet.store, [(edge, p.prediction_id) for p in recent])
    desired = fleet.desired_config(edge)
    return EdgeDetail(
        fleet_row(fleet, view),
        view,
        desired,
        config_history(fleet, edge),
        recent,
        frozenset(prediction_id for _, prediction_id in shared),
        images(desired),
        () if manifest is None else tuple(manifest.classes),
    )


def model_classes(fleet: Fleet, model_ref: str) -> tuple[str, ...]:
    manifest = manifest_of(fleet, model_ref)
    # A model this registry never held: no choices offered, none accepted.
    return () if manifest is None else tuple(manifest.classes)

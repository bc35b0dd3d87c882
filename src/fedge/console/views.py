"""What the pages show, read through the Fleet library; formatted once for HTML and SSE.

A fleet row is turned into display cells here, and both the template and the live
update stream send those same cells, so a value on an open page never differs from the
same value after a reload.
"""

import datetime
from dataclasses import dataclass

from fedge.console.queries import ConfigVersion, config_at, config_history
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.edge_view_store import Gap
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.fleet.predictions import PredictionFilter, PredictionView, list_predictions
from fedge.edge_manager.fleet.views import EdgeView
from fedge.edge_manager.ingest import thumbnail_store
from fedge.protocols.config import EdgeConfig

QUEUE_LIMIT = 50
RECENT_PREDICTIONS = 20


def when(ts: float | None) -> str:
    """Local date and time to the second, or '-' (the CLI's format)."""
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(float(ts)).strftime("%Y-%m-%d %H:%M:%S")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def thresholds(config: EdgeConfig | None) -> str:
    if config is None:
        return "?"
    per_class = ", ".join(f"{k} {v:g}" for k, v in sorted(config.class_thresholds.items()))
    return f"{config.default_threshold:g}" + (f" ({per_class})" if per_class else "")


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

    @classmethod
    def of(cls, view: EdgeView) -> "EdgeFigures":
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
        )


@dataclass(frozen=True)
class FleetRow:
    edge: str
    state: str
    in_sync: bool
    cells: dict[str, str]  # field -> text, the same on the page and in live updates


@dataclass(frozen=True)
class EdgeDetail:
    row: FleetRow
    view: EdgeView  # Fleet.show's
    desired: EdgeConfig | None
    history: list[ConfigVersion]
    predictions: list[PredictionView]
    thumbnails: frozenset[str]  # the predictions above whose image the station shared
    images: str  # what the station's config says of its images


def images(config: EdgeConfig | None) -> str:
    policy = None if config is None else config.thumbnails
    if policy is None:
        return "stay on the station (no thumbnails shared)"
    which = "rejected" if policy.rejects_only else "all scored"
    return f"thumbnails of {which} images shared, {policy.size} px, at most {policy.per_minute}/min"


@dataclass(frozen=True)
class QueueItem:
    prediction: PredictionView
    classes: tuple[str, ...]  # what it can be labelled: its model's classes
    thumbnail: bool = False  # its station shared the image's thumbnail


def cells(edge: EdgeFigures, in_force: EdgeConfig | None) -> dict[str, str]:
    """One edge's display cells from its figures and the config it applied (None:
    unknown)."""
    predictions = edge.predictions
    gaps = edge.gaps
    missing = sum(g.to_seq - g.from_seq + 1 for g in gaps)
    return {
        "state": edge.state,
        "serving": edge.serving or "-",
        "config": f"v{edge.desired_config_version} / v{edge.config_applied}",
        "sync": "in sync" if edge.in_sync else "converging",
        # Before its first report an edge decides with the agent's defaults: shown, but
        # marked, so it does not read as a threshold the edge reported applying.
        "threshold": thresholds(in_force) + (" (default)" if edge.config_applied == 0 else ""),
        "last_seen": when(edge.last_seen),
        "predictions": str(predictions),
        "reject_rate": percent(edge.rejects / predictions if predictions else None),
        "agreement": percent(edge.label_agreement),
        "gaps": f"{len(gaps)} ({missing} batch{'' if missing == 1 else 'es'})" if gaps else "none",
    }


def table_row(edge: EdgeFigures, in_force: EdgeConfig | None) -> FleetRow:
    """The fleet table's row of ``edge``, and the head of its own page."""
    return FleetRow(edge.edge, edge.state, edge.in_sync, cells(edge, in_force))


def fleet_row(fleet: Fleet, view: EdgeView) -> FleetRow:
    """One edge's row from its own view (fleet_table.py builds a whole fleet's at once)."""
    return table_row(EdgeFigures.of(view), config_at(fleet, view.edge, view.config_applied))


def edge_detail(fleet: Fleet, edge: str) -> EdgeDetail:
    """Raises UnknownEdgeError (a ManagerError) for an edge that is not enrolled."""
    view = fleet.show(edge)
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
    )


def model_classes(fleet: Fleet, model_ref: str) -> tuple[str, ...]:
    name, _, version = model_ref.rpartition(":")
    if not version.isdigit():
        return ()
    try:
        return tuple(fleet.registry.get(name, int(version)).manifest.classes)
    except ManagerError:
        return ()  # a model this registry never held: no choices offered, none accepted


def label_queue(fleet: Fleet, limit: int = QUEUE_LIMIT) -> list[QueueItem]:
    unlabelled = list_predictions(fleet.store, PredictionFilter(unlabelled=True, limit=limit))
    shared = thumbnail_store.available(fleet.store, [(p.edge, p.prediction_id) for p in unlabelled])
    classes: dict[str, tuple[str, ...]] = {}
    items = []
    for prediction in unlabelled:
        if prediction.model not in classes:
            classes[prediction.model] = model_classes(fleet, prediction.model)
        thumbnail = (prediction.edge, prediction.prediction_id) in shared
        items.append(QueueItem(prediction, classes[prediction.model], thumbnail))
    return items

"""One edge as an operator sees it: its desired config beside what it reported.

Split out of fleet.py (one concept per module); :meth:`Fleet.show` calls :func:`show`.
What it reads of the store is in edge_view_store.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from fedge.edge_manager import edge_view_store
from fedge.edge_manager.errors import ManagerError, UnknownEdgeError
from fedge.edge_manager.registry import parse_ref
from fedge.party.privacy_status import SPENT_METRIC
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig

if TYPE_CHECKING:
    from fedge.edge_manager.fleet import Fleet


def show(fleet: Fleet, edge: str) -> dict[str, Any]:
    row = edge_view_store.reported(fleet.store, edge)
    if row is None:
        raise UnknownEdgeError(f"unknown edge {edge!r}; see `fedge edge list`")
    desired = fleet.desired_config(edge)
    row["desired_config"] = None if desired is None else json.loads(codec.encode(desired))
    row["desired_config_version"] = 0 if desired is None else desired.version
    row["in_sync"] = row["desired_config_version"] == row["config_applied"]
    row["thresholds_for"] = None if desired is None else desired.model
    row["thresholds_source"] = thresholds_source(fleet, desired, str(row["serving"] or ""))
    row.update(asdict(edge_view_store.prediction_counts(fleet.store, edge)))
    row["labels"] = edge_view_store.count(fleet.store, "labels", edge)
    row["telemetry"] = edge_view_store.count(fleet.store, "telemetry", edge)
    row["gaps"] = [asdict(gap) for gap in edge_view_store.gaps(fleet.store, edge)]
    row["rejections"] = edge_view_store.count(fleet.store, "rejections", edge)
    row["label_agreement"] = fleet.label_agreement(edge)
    # The epsilon the station spent over all jobs, as its agent last reported it (its
    # ClientApp's report, fedge.party.privacy_status). None: never reported.
    row["privacy_epsilon_spent"] = edge_view_store.latest_metric(fleet.store, edge, SPENT_METRIC)
    return row


def thresholds_source(fleet: Fleet, desired: EdgeConfig | None, serving: str) -> str:
    """Where the serving model's thresholds come from on the edge (the agent's rule,
    fedge.edge_agent.decisions.thresholds_in_force): config, model or untied."""
    if desired is not None and (desired.model in (None, serving) or not serving):
        return "config"
    try:
        recommended = fleet.registry.get(*parse_ref(serving)).manifest.thresholds
    except ManagerError:  # nothing serves, or a model this registry does not know
        recommended = None
    if recommended is not None:
        return "model"
    return "default" if desired is None else "untied"

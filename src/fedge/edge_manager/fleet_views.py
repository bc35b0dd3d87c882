"""One edge as an operator sees it: its desired config beside what it reported.

Split out of fleet.py (one concept per module); :meth:`Fleet.show` calls :func:`show`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fedge.edge_manager.errors import ManagerError, UnknownEdgeError
from fedge.edge_manager.registry import parse_ref
from fedge.party.privacy_status import SPENT_METRIC
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig

if TYPE_CHECKING:
    from fedge.edge_manager.fleet import Fleet


def show(fleet: Fleet, edge: str) -> dict[str, Any]:
    row = fleet.store.one("SELECT * FROM edges WHERE edge=?", (edge,))
    if row is None:
        raise UnknownEdgeError(f"unknown edge {edge!r}; see `fedge edge list`")
    row.pop("token_sha256")
    desired = fleet.desired_config(edge)
    row["desired_config"] = None if desired is None else json.loads(codec.encode(desired))
    row["desired_config_version"] = 0 if desired is None else desired.version
    row["in_sync"] = row["desired_config_version"] == row["config_applied"]
    row["thresholds_for"] = None if desired is None else desired.model
    row["thresholds_source"] = thresholds_source(fleet, desired, str(row["serving"] or ""))
    counts = fleet.store.one(
        "SELECT count(*) AS predictions, "
        "coalesce(sum(decision='reject'), 0) AS rejects, "
        "coalesce(sum(decision='accept'), 0) AS accepts FROM predictions WHERE edge=?",
        (edge,),
    )
    row.update(counts or {})
    row["labels"] = fleet.store.scalar("SELECT count(*) FROM labels WHERE edge=?", (edge,))
    row["telemetry"] = fleet.store.scalar("SELECT count(*) FROM telemetry WHERE edge=?", (edge,))
    row["gaps"] = fleet.store.query(
        "SELECT stream, from_seq, to_seq FROM gaps WHERE edge=? ORDER BY stream, from_seq",
        (edge,),
    )
    row["rejections"] = fleet.store.scalar("SELECT count(*) FROM rejections WHERE edge=?", (edge,))
    row["label_agreement"] = fleet.label_agreement(edge)
    # The epsilon the station spent over all jobs, as its agent last reported it (its
    # ClientApp's report, fedge.party.privacy_status). None: never reported.
    row["privacy_epsilon_spent"] = fleet.store.scalar(
        "SELECT value FROM telemetry WHERE edge=? AND name=? ORDER BY at DESC LIMIT 1",
        (edge, SPENT_METRIC),
    )
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

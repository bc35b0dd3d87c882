"""One edge as an operator sees it: its desired config beside what it reported.

Split out of fleet.py (one concept per module); :meth:`Fleet.show` calls :func:`show`,
which returns an :class:`EdgeView`. What it reads of the store is in edge_view_store.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from fedge.edge_manager.errors import ManagerError, UnknownEdgeError
from fedge.edge_manager.fleet import edge_view_store
from fedge.edge_manager.fleet.edge_view_store import Gap
from fedge.edge_manager.registry.versions import parse_ref
from fedge.party.privacy_status import FLOOR_JOB_METRIC, FLOOR_METRIC, SPENT_METRIC
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig

if TYPE_CHECKING:
    from fedge.edge_manager.fleet.operations import Fleet

# Where the serving model's thresholds come from on the edge (:func:`thresholds_source`).
ThresholdsSource = Literal["config", "model", "untied", "default"]


@dataclass(frozen=True)
class EdgeView:
    """One edge, desired beside reported: what ``fedge edge show`` prints.

    The fields up to ``deploy_reason`` are its row of the ``edges`` table as it last
    reported (edge_view_store.ReportedEdge); the rest are computed. :meth:`to_json` is the
    object ``fedge edge show --json`` prints: these fields, in this order.
    """

    edge: str
    enrolled_at: float
    state: str  # an EdgeState value, 'never-seen' or 'revoked'
    session: int  # -1: never seen
    last_seen: float | None
    agent_version: str
    serving: str  # a model reference, '' when it serves none
    config_applied: int  # the config version it reported applied, 0: none
    config_status: str
    config_reason: str
    config_reported_at: float | None
    deploy_id: str
    deploy_stage: str
    deploy_reason: str
    desired_config: dict[str, Any] | None  # the newest desired config document (JSON)
    desired_config_version: int  # 0: none desired
    in_sync: bool  # it applied the newest desired config version
    thresholds_for: str | None  # the model the desired thresholds are for (None: any)
    thresholds_source: ThresholdsSource
    predictions: int
    rejects: int
    accepts: int
    labels: int
    telemetry: int  # telemetry records received
    gaps: tuple[Gap, ...]  # open gaps, by stream and start
    rejections: int  # messages from it the manager rejected
    label_agreement: float | None  # None: nothing labelled
    # The epsilon the station spent over all jobs, as its agent last reported it (its
    # ClientApp's report, fedge.party.privacy_status). None: never reported.
    privacy_epsilon_spent: float | None
    # The station's own privacy floor as its agent last reported it: lifetime and per-job
    # epsilon; lifetime 0.0: its operator opted out of a floor. None: never reported.
    privacy_floor_epsilon: float | None = None
    privacy_floor_job_epsilon: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object ``fedge edge show --json`` prints (gaps as a list of objects)."""
        shown = asdict(self)
        shown["gaps"] = [asdict(gap) for gap in self.gaps]
        return shown


def show(fleet: Fleet, edge: str) -> EdgeView:
    row = edge_view_store.reported(fleet.store, edge)
    if row is None:
        raise UnknownEdgeError(f"unknown edge {edge!r}; see `fedge edge list`")
    desired = fleet.desired_config(edge)
    desired_version = 0 if desired is None else desired.version
    counts = edge_view_store.prediction_counts(fleet.store, edge)
    return EdgeView(
        edge=row.edge,
        enrolled_at=row.enrolled_at,
        state=row.state,
        session=row.session,
        last_seen=row.last_seen,
        agent_version=row.agent_version,
        serving=row.serving,
        config_applied=row.config_applied,
        config_status=row.config_status,
        config_reason=row.config_reason,
        config_reported_at=row.config_reported_at,
        deploy_id=row.deploy_id,
        deploy_stage=row.deploy_stage,
        deploy_reason=row.deploy_reason,
        desired_config=None if desired is None else json.loads(codec.encode(desired)),
        desired_config_version=desired_version,
        in_sync=desired_version == row.config_applied,
        thresholds_for=None if desired is None else desired.model,
        thresholds_source=thresholds_source(fleet, desired, row.serving),
        predictions=counts.predictions,
        rejects=counts.rejects,
        accepts=counts.accepts,
        labels=edge_view_store.count(fleet.store, "labels", edge),
        telemetry=edge_view_store.count(fleet.store, "telemetry", edge),
        gaps=edge_view_store.gaps(fleet.store, edge),
        rejections=edge_view_store.count(fleet.store, "rejections", edge),
        label_agreement=fleet.label_agreement(edge),
        privacy_epsilon_spent=edge_view_store.latest_metric(fleet.store, edge, SPENT_METRIC),
        privacy_floor_epsilon=edge_view_store.latest_metric(fleet.store, edge, FLOOR_METRIC),
        privacy_floor_job_epsilon=edge_view_store.latest_metric(
            fleet.store, edge, FLOOR_JOB_METRIC
        ),
    )


def thresholds_source(fleet: Fleet, desired: EdgeConfig | None, serving: str) -> ThresholdsSource:
    """Where the serving model's thresholds come from on the edge (the agent's rule,
    fedge.edge_agent.config.decisions.thresholds_in_force): config, model, untied or default."""
    if desired is not None and (desired.model in (None, serving) or not serving):
        return "config"
    try:
        recommended = fleet.registry.get(*parse_ref(serving)).manifest.thresholds
    except ManagerError:  # nothing serves, or a model this registry does not know
        recommended = None
    if recommended is not None:
        return "model"
    return "default" if desired is None else "untied"

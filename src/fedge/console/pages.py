"""Each page's template context, read through the library (no SQL here either)."""

from typing import Any

from fedge.console import (
    alerts,
    audit,
    histograms,
    images,
    incidents,
    jobs,
    model_page,
    registry_views,
    teams,
    trends,
    views,
)
from fedge.console.accounts import Account
from fedge.console.fleet_table import PER_PAGE, STATES, TableQuery, fleet_table
from fedge.console.queue import QueueQuery, label_queue
from fedge.edge_manager.fleet.operations import Fleet


def context(
    fleet: Fleet,
    kind: str,
    key: str,
    params: dict[str, str],
    serve_notice: str | None = None,
    viewer: Account | None = None,
) -> dict[str, Any]:
    """What page ``kind`` shows (``key``: its edge, job or rollout id; ``params``: the
    query string; ``serve_notice``: what is wrong with ``manager serve``, health.py;
    ``viewer``: who reads it, for what their teams may see)."""
    if kind == "fleet":
        table = fleet_table(fleet, TableQuery.parse(params), serve_notice=serve_notice)
        return {
            "table": table,
            "rows": table.rows,
            "states": STATES,
            "per_page_choices": PER_PAGE,
        }
    if kind == "edge":
        return {
            "detail": views.edge_detail(fleet, key),
            "histograms": histograms.score_histograms(fleet, key),
            "deploys": histograms.deploy_history(fleet, key),
            "rollbacks": incidents.edge_rollbacks(fleet, key),
            "viewing": images.station_viewing(fleet, [key])[key],
            "trends": trends.edge_trends(fleet, key),
        }
    if kind == "labels":
        queue = label_queue(fleet, QueueQuery.parse(params))
        shown = sorted({item.prediction.edge for item in queue.items})
        return {"queue": queue, "viewing": images.station_viewing(fleet, shown)}
    if kind == "jobs":
        return {"jobs": jobs.list_jobs(fleet, viewer)}
    if kind == "job":
        return {"detail": jobs.job_detail(fleet, key, viewer)}
    if kind == "alerts":
        return {"board": alerts.alerts_page(fleet, params.get("all") == "1")}
    if kind == "alert":
        return {"shown": alerts.alert_page(fleet, key)}
    if kind == "teams" and viewer is not None:
        return {"teams": teams.teams_page(fleet, viewer), "roles": teams.ROLES}
    if kind == "models":
        return {"registry": registry_views.models_page(fleet, viewer)}
    if kind == "model":
        name, _, version = key.rpartition(":")
        return {"model_view": model_page.model_page(fleet, name, version, viewer)}
    if kind == "rollouts":
        return {"rollouts": registry_views.rollouts_page(fleet)}
    if kind == "rollout":
        rollout = registry_views.rollout_page(fleet, key)
        return {"rollout": rollout, "actions": rollout["actions"]}
    return {"entries": audit.recent(fleet.store)}

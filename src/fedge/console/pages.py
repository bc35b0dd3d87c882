"""Each page's template context, read through the library (no SQL here either)."""

from typing import Any

from fedge.console import actions, audit, histograms, jobs, registry_views, views
from fedge.console.fleet_table import STATES, TableQuery, fleet_table
from fedge.console.queue import QueueQuery, label_queue
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.monitor import alert_store


def context(
    fleet: Fleet, kind: str, key: str, params: dict[str, str], serve_notice: str | None = None
) -> dict[str, Any]:
    """What page ``kind`` shows (``key``: its edge, job or rollout id; ``params``: the
    query string; ``serve_notice``: what is wrong with ``manager serve``, health.py)."""
    if kind == "fleet":
        table = fleet_table(fleet, TableQuery.parse(params), serve_notice=serve_notice)
        return {"table": table, "rows": table.rows, "states": STATES}
    if kind == "edge":
        return {
            "detail": views.edge_detail(fleet, key),
            "histograms": histograms.score_histograms(fleet, key),
            "deploys": histograms.deploy_history(fleet, key),
        }
    if kind == "labels":
        return {"queue": label_queue(fleet, QueueQuery.parse(params))}
    if kind == "jobs":
        return {"jobs": jobs.list_jobs(fleet)}
    if kind == "job":
        return {"detail": jobs.job_detail(fleet, key)}
    if kind == "alerts":
        every = params.get("all") == "1"
        return {
            "alerts": alert_store.list_alerts(fleet.store, include_cleared=every),
            "show_cleared": every,
        }
    if kind == "models":
        return {"registry": registry_views.models_page(fleet)}
    if kind == "rollouts":
        return {"rollouts": registry_views.rollouts_page(fleet)}
    if kind == "rollout":
        return {
            "rollout": registry_views.rollout_page(fleet, key),
            "actions": actions.ROLLOUT_OPERATIONS,
        }
    return {"entries": audit.recent(fleet.store)}

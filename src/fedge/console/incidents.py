"""One incident, one page (issue 30, item 5): what tripped a rollout, and the alerts and
figures behind it; which rollouts sent an edge back.

A rollout's abort is recorded as its ``aborted`` event, whose detail is the criteria that
tripped, joined by '; ', each as the state machine words it (rollout/machine.py
``_tripped``): ``st-03: agreement_drop=0.15 > 0.05``, ``st-03: failed_activation=1 (a
failed activation always aborts)``, ``st-03: probation_timeout (...)``. :func:`tripped`
reads them back (an operator's own reason is kept as it is). For each, the evidence: the
alerts that counted (about the rollout's model, raised on the edge between its move and
the abort), the station's deployment reports, and the figure read again now through the
rollout's own health readers (rollout/health.py), beside the value that tripped.
"""

import re
from dataclasses import dataclass, field
from typing import Any

from fedge.console import incident_store
from fedge.console.conditions import Condition, criterion
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.alert_store import AlertView
from fedge.edge_manager.rollout import health
from fedge.edge_manager.rollout.plan import Metric

_TRIPPED = re.compile(
    r"^(?P<edge>[A-Za-z0-9._-]+): (?P<metric>[a-z0-9_]+)"
    r"(?:=(?P<observed>\S+?))?(?: (?P<op>>=|>) (?P<limit>\S+))?(?:\s+(?P<note>.*))?$"
)
SENT_BACK = frozenset({"rolling_back", "rolled_back", "unconfirmed"})


@dataclass(frozen=True)
class Tripped:
    """One criterion that held on one edge, as the abort recorded it."""

    text: str
    edge: str = ""  # '' : not a criterion (an operator's reason, an error)
    metric: str = ""
    observed: float | None = None
    op: str = ""
    limit: float | None = None
    note: str = ""


def _number(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def tripped(reason: str) -> list[Tripped]:
    """The criteria of an abort's recorded reason, in order."""
    found = []
    for part in (p.strip() for p in reason.split("; ")):
        if not part:
            continue
        match = _TRIPPED.match(part)
        if match is None:
            found.append(Tripped(part))
            continue
        found.append(
            Tripped(
                part,
                match["edge"],
                match["metric"],
                _number(match["observed"]),
                match["op"] or "",
                _number(match["limit"]),
                (match["note"] or "").strip("() "),
            )
        )
    return found


@dataclass(frozen=True)
class Evidence:
    """What stands behind one tripped criterion."""

    tripped: Tripped
    condition: Condition | None  # None: not a criterion (an operator's reason)
    alerts: list[AlertView] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)  # (what, value)


@dataclass(frozen=True)
class RolloutIncident:
    aborted_at: float | None
    reason: str  # the abort's recorded reason ('' : not aborted)
    evidence: list[Evidence]
    degraded: list[dict[str, Any]]  # the rollout's 'degraded' events
    local_rollbacks: list[AlertView]  # local_rollback alerts naming this rollout


def _percent(value: float | None) -> str:
    return "not enough labels yet" if value is None else f"{value:.0%}"


def _figures(fleet: Fleet, model: str, edge: dict[str, Any], metric: str) -> list[tuple[str, str]]:
    """The figure behind ``metric`` on ``edge`` (a rollout status edge), read again now."""
    conn = fleet.store.conn
    name, previous = edge["edge"], edge["previous_model"] or ""
    moved_at, deployment = edge["moved_at"], edge["deployment_id"] or ""
    figures: list[tuple[str, str]] = []
    if metric == Metric.FAILED_ACTIVATION.value and deployment:
        for _at, stage, why in incident_store.deploy_reasons(fleet.store, name, deployment):
            figures.append((f"{name} reported {stage}", why or "-"))
    if metric == Metric.AGREEMENT_DROP.value and moved_at is not None:
        figures.append(
            (
                f"labels agreeing with {previous} (before)",
                _percent(health.agreement(conn, name, previous)),
            )
        )
        figures.append(
            (
                f"labels agreeing with {model} (since the move)",
                _percent(health.agreement(conn, name, model, since=moved_at)),
            )
        )
    try:
        known = Metric(metric)
    except ValueError:
        return figures
    if moved_at is not None and known is not Metric.FAILED_ACTIVATION:
        now = health.moved_health(
            conn,
            edge=name,
            model=model,
            previous_model=previous,
            deployment_id=deployment,
            moved_at=float(moved_at),
            metrics=[known],
        )
        value = now.metrics.get(known.value)
        figures.append(
            (
                f"{metric} read again now",
                "not enough evidence yet" if value is None else f"{value:.4g}",
            )
        )
    return figures


def rollout_incident(fleet: Fleet, status: dict[str, Any]) -> RolloutIncident:
    """What tripped the rollout ``status`` (rollout_views.status) and the evidence."""
    rollout_id, model = status["rollout_id"], status["model"]
    aborted = [e for e in status["events"] if e["kind"] == "aborted"]
    edges = {e["edge"]: e for e in status["edges"]}
    evidence: list[Evidence] = []
    aborted_at = None if not aborted else float(aborted[-1]["at"])
    reason = "" if not aborted else str(aborted[-1]["detail"])
    for item in tripped(reason):
        edge = edges.get(item.edge)
        if edge is None or not item.metric:
            evidence.append(Evidence(item, None))
            continue
        alerts: list[AlertView] = []
        if item.metric == Metric.ALERTS.value and edge["moved_at"] is not None:
            alerts = alert_store.list_alerts(
                fleet.store,
                edge=item.edge,
                model=model,
                include_cleared=True,
                raised_from=float(edge["moved_at"]),
                raised_until=aborted_at,
            )
        evidence.append(
            Evidence(
                item, criterion(item.metric), alerts, _figures(fleet, model, edge, item.metric)
            )
        )
    local = [
        a
        for a in alert_store.list_alerts(fleet.store, model=model, include_cleared=True)
        if a.kind == "local_rollback" and a.detail.get("rollout") == rollout_id
    ]
    degraded = [e for e in status["events"] if e["kind"] == "degraded"]
    return RolloutIncident(aborted_at, reason, evidence, degraded, local)


@dataclass(frozen=True)
class EdgeRollback:
    """A rollout that sent this edge back, or that this edge rolled back on its own."""

    rollout_id: str
    model: str  # the model it was sent back from
    previous_model: str  # what it went back to
    at: float  # when the rollout ended (or last changed)
    verb: str  # 'rolled back by' (the rollout's id follows)
    reason: str

    @property
    def how(self) -> str:
        return f"{self.verb} {self.rollout_id}"


def edge_rollbacks(fleet: Fleet, edge: str) -> list[EdgeRollback]:
    """The rollouts that took ``edge`` back off their model, newest first."""
    found = []
    parts = incident_store.rollouts_of_edge(fleet.store, edge)
    for part in parts:
        if part.edge_state not in SENT_BACK:
            continue
        verb = {
            "rolling_back": "being rolled back by",
            "rolled_back": "rolled back by",
            "unconfirmed": "sent back (never confirmed) by",
        }[part.edge_state]
        at = part.finished_at if part.finished_at is not None else part.updated_at
        found.append(
            EdgeRollback(part.rollout_id, part.model, part.previous_model, at, verb, part.reason)
        )
    by_rollout = {p.rollout_id: p for p in parts}
    for rollout_id, at, detail in incident_store.degraded_by(fleet.store, edge):
        known = by_rollout.get(rollout_id)
        model = "" if known is None else known.model
        previous = "" if known is None else known.previous_model
        verb = "rolled back on its own, after completing"
        found.append(EdgeRollback(rollout_id, model, previous, at, verb, detail))
    return sorted(found, key=lambda r: r.at, reverse=True)

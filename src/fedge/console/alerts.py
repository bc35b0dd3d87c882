"""The alerts pages (issue 30, item 6): alerts an operator can act on.

The monitor raises one alert per (edge, model, condition); a model that goes wrong on a
station typically raises two or three at once (its inputs drift, so its scores drift, so
its estimated accuracy falls). The page shows one *incident* per station and cause --
(edge, model): the alerts of one model on one station -- with each condition said in
words (conditions.py), its severity (the highest of its alerts), the rollout that moved
the station to that model, and who acknowledged it.

Acknowledging is not clearing. *Acknowledge* says "seen, someone is on it": the alerts
stay open and watched, and the acknowledgement (who, when, a required note) is kept with
them. *Clear* closes them as ``fedge alerts clear`` does (the condition is not raised
again until it has stopped holding once). Both take a required note, act on several
incidents at once, and land in the audit log with the note.
"""

import time
from collections import defaultdict
from dataclasses import dataclass, field

from fedge.console import console_store, incident_store
from fedge.console.conditions import Condition, Severity, alert_condition
from fedge.console.console_store import AlertAck
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.alert_store import AlertView


@dataclass(frozen=True)
class ShownAlert:
    alert: AlertView
    condition: Condition
    ack: AlertAck | None
    rollout: str | None  # the rollout that moved the edge to the alert's model

    @property
    def reading(self) -> str:
        return self.condition.reading(self.alert.value, self.alert.threshold)


@dataclass(frozen=True)
class Incident:
    """The open alerts of one model on one station."""

    edge: str
    model: str
    alerts: list[ShownAlert] = field(default_factory=list)

    @property
    def key(self) -> str:
        return ",".join(a.alert.alert_id for a in self.alerts)

    @property
    def severity(self) -> Severity:
        return max(a.condition.severity for a in self.alerts)

    @property
    def raised_at(self) -> float:
        return min(a.alert.raised_at for a in self.alerts)

    @property
    def rollout(self) -> str | None:
        return next((a.rollout for a in self.alerts if a.rollout), None)

    @property
    def acks(self) -> list[AlertAck]:
        seen = {}
        for a in self.alerts:
            if a.ack is not None:
                seen[(a.ack.who, a.ack.note, round(a.ack.at))] = a.ack
        return sorted(seen.values(), key=lambda ack: ack.at)


def _rollout_of(fleet: Fleet, alert: AlertView) -> str | None:
    named = alert.detail.get("rollout")
    if isinstance(named, str) and named:
        return named
    return incident_store.rollout_that_moved(fleet.store, alert.edge, alert.model, alert.raised_at)


def shown(fleet: Fleet, alerts: list[AlertView]) -> list[ShownAlert]:
    console_store.ensure_tables(fleet.store)
    acks = console_store.alert_acks(fleet.store, [a.alert_id for a in alerts])
    rollouts: dict[tuple[str, str], str | None] = {}
    result = []
    for alert in alerts:
        key = (alert.edge, alert.model)
        if alert.kind == "local_rollback" or key not in rollouts:
            found = _rollout_of(fleet, alert)
            if alert.kind != "local_rollback":
                rollouts[key] = found
        else:
            found = rollouts[key]
        result.append(
            ShownAlert(alert, alert_condition(alert.kind), acks.get(alert.alert_id), found)
        )
    return result


def incidents(alerts: list[ShownAlert]) -> list[Incident]:
    """Open alerts grouped per (edge, model), most severe then newest first."""
    grouped: dict[tuple[str, str], list[ShownAlert]] = defaultdict(list)
    for a in alerts:
        grouped[(a.alert.edge, a.alert.model)].append(a)
    found = [
        Incident(edge, model, sorted(items, key=lambda a: (-a.condition.severity, a.alert.kind)))
        for (edge, model), items in grouped.items()
    ]
    return sorted(found, key=lambda i: (-i.severity, -i.raised_at))


@dataclass(frozen=True)
class AlertsPage:
    incidents: list[Incident]  # the open alerts
    cleared: list[ShownAlert]  # with ?all=1: the cleared ones too, newest first
    show_cleared: bool


def alerts_page(fleet: Fleet, show_cleared: bool) -> AlertsPage:
    open_alerts = shown(fleet, alert_store.list_alerts(fleet.store))
    cleared: list[ShownAlert] = []
    if show_cleared:
        every = alert_store.list_alerts(fleet.store, include_cleared=True)
        cleared = shown(fleet, [a for a in every if not a.is_open])
    return AlertsPage(incidents(open_alerts), cleared, show_cleared)


def alert_page(fleet: Fleet, alert_id: str) -> ShownAlert:
    """Raises UnknownAlertError (a ManagerError) for an unknown alert."""
    (one,) = shown(fleet, [alert_store.get_alert(fleet.store, alert_id)])
    return one


def acknowledge(fleet: Fleet, alert_ids: list[str], note: str, who: str) -> None:
    """Record ``who``'s acknowledgement of open alerts; they stay open."""
    now = time.time()
    console_store.ensure_tables(fleet.store)
    with fleet.store.transaction():
        for alert_id in alert_ids:
            console_store.put_alert_ack(fleet.store, AlertAck(alert_id, who, note, now))

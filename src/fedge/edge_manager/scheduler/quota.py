"""Team quotas in station-hours a day: what each team's jobs held in the last 24 hours.

A job holds its stations from the moment it is placed (``running``) until it lets them
go (``suspended``, ``cancelled``, ``completed``, ``failed``); ``suspending`` and
``cancelling`` jobs still hold them while they finish their round. Station time is that
span times the stations it needs, counted only inside the window ``[since, now]`` -- so
a job submitted days ago and still running counts today's hours, and a job that ran
yesterday stops counting once its hours leave the window.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fedge.edge_manager.scheduler.lifecycle import HOLDING

_HOLDING = frozenset(state.value for state in HOLDING)


@dataclass(frozen=True)
class HoldEvent:
    """One state change of a job of a team with a quota (its queue_events row)."""

    job_id: str
    team: str
    demand: int
    at: float
    state: str


def used_station_seconds(events: Iterable[HoldEvent], since: float, now: float) -> dict[str, float]:
    """Station-seconds each team's jobs held inside ``[since, now]`` (events in time
    order per job)."""
    used: dict[str, float] = {}
    held_from: dict[str, float] = {}
    last: dict[str, HoldEvent] = {}
    for event in events:
        last[event.job_id] = event
        holding = event.state in _HOLDING
        if holding and event.job_id not in held_from:
            held_from[event.job_id] = event.at
        elif not holding and event.job_id in held_from:
            start = held_from.pop(event.job_id)
            _add(used, event, start, event.at, since)
        used.setdefault(event.team, 0.0)
    for job_id, start in held_from.items():  # still holding its stations
        _add(used, last[job_id], start, now, since)
    return used


def _add(used: dict[str, float], event: HoldEvent, start: float, end: float, since: float) -> None:
    span = end - max(start, since)
    if span > 0:
        used[event.team] = used.get(event.team, 0.0) + span * event.demand

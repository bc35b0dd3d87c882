"""A submission checked before anything is queued: team, stations, grace, preemptions.

``stations`` is one of ``all`` (every enrolled station), ``any N`` (N of the fleet),
``any N of a,b,c`` or ``a,b,c`` (all of these). Every error names what was wrong and
what to give instead; a refused submission queues nothing.
"""

from collections.abc import Collection

from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.queue import Job, JobKind
from fedge.edge_manager.scheduler.teams import check_known_team


def parse_stations(spec: str, enrolled: Collection[str]) -> tuple[frozenset[str] | None, int]:
    """``(stations, demand)``: the stations a job may use (None: any) and how many."""
    text = spec.strip()
    if not enrolled:
        raise SchedulerError("no station is enrolled; enroll stations before submitting jobs")
    if text == "all":
        return frozenset(enrolled), len(enrolled)
    if text.startswith("any "):
        count_text, _, names_text = text[4:].partition(" of ")
        try:
            demand = int(count_text)
        except ValueError as exc:
            raise SchedulerError(f"stations {spec!r}: 'any N' needs a whole number N") from exc
        if demand < 1:
            raise SchedulerError(f"stations {spec!r}: 'any N' needs N >= 1")
        if not names_text:
            if demand > len(enrolled):
                raise SchedulerError(
                    f"stations {spec!r}: the fleet has only {len(enrolled)} enrolled stations"
                )
            return None, demand
        names = _known(names_text, enrolled)
        if demand > len(names):
            raise SchedulerError(f"stations {spec!r}: needs {demand} but names {len(names)}")
        return names, demand
    names = _known(text, enrolled)
    return names, len(names)


def _known(names_text: str, enrolled: Collection[str]) -> frozenset[str]:
    names = frozenset(n.strip() for n in names_text.split(",") if n.strip())
    if not names:
        raise SchedulerError("no station named; give 'all', 'any N' or a comma-separated list")
    unknown = sorted(names - set(enrolled))
    if unknown:
        raise SchedulerError(
            f"unknown stations: {', '.join(unknown)}; enrolled: {', '.join(sorted(enrolled))}"
        )
    return names


def build_job(
    *,
    job_id: str,
    kind: str,
    team: str,
    stations: str,
    grace_s: float,
    max_preemptions: int,
    priority: int,
    now: float,
    teams: Collection[str],
    enrolled: Collection[str],
) -> Job:
    try:
        job_kind = JobKind(kind)
    except ValueError as exc:
        raise SchedulerError(f"kind {kind!r}: give te (urgent) or be (best effort)") from exc
    check_known_team(team, teams)
    names, demand = parse_stations(stations, enrolled)
    return Job(
        job_id,
        job_kind,
        team,
        demand,
        submitted_at=now,
        grace_s=grace_s,
        stations=names,
        max_preemptions=max_preemptions,
        priority=priority,
    )

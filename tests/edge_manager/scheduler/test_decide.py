"""The scheduler's decisions against hand-computed cases (FitGpp, OpML'19; issue 31)."""

import pytest

from fedge.edge_manager.scheduler.decide import decide
from fedge.edge_manager.scheduler.errors import SchedulerError
from fedge.edge_manager.scheduler.policy import Policy, PolicyName, queue_key
from fedge.edge_manager.scheduler.queue import (
    Job,
    JobKind,
    Placement,
    Queued,
    Running,
    State,
    Station,
    StationDrop,
    Suspension,
)
from fedge.edge_manager.scheduler.windows import IdleWindow, ShiftWindow

FITGPP = Policy(PolicyName.FITGPP, cap=1, grace_weight=4.0)
SIX = tuple(Station(f"s{i}") for i in range(1, 7))


def job(
    job_id: str,
    kind: JobKind = JobKind.BE,
    demand: int = 1,
    grace_s: float = 60.0,
    *,
    at: float = 0.0,
    team: str = "vision",
    stations: frozenset[str] | None = None,
    max_preemptions: int = 5,
    expected_run_s: float | None = None,
) -> Job:
    return Job(
        job_id,
        kind,
        team,
        demand,
        submitted_at=at,
        grace_s=grace_s,
        stations=stations,
        max_preemptions=max_preemptions,
        expected_run_s=expected_run_s,
    )


def run(j: Job, *stations: str, preemptions: int = 0, waited_s: float = 0.0) -> Running:
    return Running(j, stations, started_at=0.0, preemptions=preemptions, waited_s=waited_s)


def te(demand: int, job_id: str = "urgent") -> Queued:
    return Queued(job(job_id, JobKind.TE, demand, at=100.0), queued_at=100.0)


def three_be(*, c_preemptions: int = 0, c_waited_s: float = 0.0) -> list[Running]:
    # useful stations A 3, B 1, C 2; grace 60, 300, 30 s.
    return [
        run(job("A", grace_s=60.0), "s1", "s2", "s3"),
        run(job("B", grace_s=300.0), "s4"),
        run(job("C", grace_s=30.0), "s5", "s6", preemptions=c_preemptions, waited_s=c_waited_s),
    ]


def test_fitgpp_suspends_the_fitting_job_with_the_smallest_score() -> None:
    # Fitting (2 stations or more): A, C. max D = 3, max GP = 300.
    # Score A = 3/3 + 4 * 60/300 = 1.8; C = 2/3 + 4 * 30/300 = 1.07 -> C.
    # B scores 1/3 + 4 = 4.33 and does not fit on its own.
    actions = decide(State(FITGPP, SIX, [te(2)], three_be()), now=100.0)
    assert actions.suspend == (Suspension("C", "urgent"),)
    assert actions.start == ()


def test_a_short_grace_period_beats_a_small_demand() -> None:
    # A holds 2 with grace 600, C holds 3 with grace 60; TE needs 2. max D 3, max GP 600.
    # A = 2/3 + 4 = 4.67, C = 1 + 4 * 0.1 = 1.4 -> C, although it is the bigger job.
    running = [
        run(job("A", grace_s=600.0), "s1", "s2"),
        run(job("C", grace_s=60.0), "s3", "s4", "s5"),
        run(job("D", grace_s=60.0), "s6"),
    ]
    actions = decide(State(FITGPP, SIX, [te(2)], running), now=100.0)
    assert actions.suspend == (Suspension("C", "urgent"),)


def test_a_job_at_the_cap_is_never_suspended() -> None:
    actions = decide(State(FITGPP, SIX, [te(2)], three_be(c_preemptions=1)), now=100.0)
    assert actions.suspend == (Suspension("A", "urgent"),)


def test_the_jobs_own_cap_applies_under_a_looser_policy() -> None:
    running = [run(job("A", grace_s=60.0, max_preemptions=0), *[s.station_id for s in SIX])]
    actions = decide(State(Policy(cap=None), SIX, [te(1)], running), now=100.0)
    assert actions.suspend == ()


def test_starvation_guard_protects_a_job_that_waited_long() -> None:
    policy = Policy(PolicyName.FITGPP, starvation_s=3600.0)
    actions = decide(State(policy, SIX, [te(2)], three_be(c_waited_s=4000.0)), now=100.0)
    assert actions.suspend == (Suspension("A", "urgent"),)


def test_no_preemption_when_even_all_candidates_cannot_make_room() -> None:
    behind = Queued(job("later", demand=1, at=200.0), queued_at=200.0)
    running = [run(job("A", max_preemptions=0), "s1", "s2", "s3", "s4", "s5"), run(job("B"), "s6")]
    actions = decide(State(FITGPP, SIX, [te(3), behind], running), now=100.0)
    # B alone frees 1 of the 3 needed: nothing is suspended, and the TE job holds the queue.
    assert actions.suspend == ()
    assert actions.start == ()


def test_several_small_jobs_are_suspended_when_none_fits_alone() -> None:
    running = [run(job(f"J{i}", grace_s=float(10 * i)), f"s{i}") for i in range(1, 7)]
    actions = decide(State(FITGPP, SIX, [te(3)], running), now=100.0)
    # All hold 1 station: the shortest grace periods go first.
    assert [s.job_id for s in actions.suspend] == ["J1", "J2", "J3"]


def test_the_claim_on_suspending_jobs_holds_and_then_the_te_job_starts() -> None:
    running = three_be()
    c = running[2]
    suspending = [running[0], running[1], Running(c.job, c.stations, 0.0, suspending=True)]
    waiting = decide(State(FITGPP, SIX, [te(2)], suspending), now=150.0)
    assert waiting.suspend == () and waiting.start == ()
    later = decide(State(FITGPP, SIX, [te(2)], running[:2]), now=200.0)
    assert later.start == (Placement("urgent", ("s5", "s6")),)


def test_a_suspended_job_resumes_at_the_head_of_the_best_effort_queue() -> None:
    new_be = Queued(job("new", at=10.0), queued_at=10.0)
    suspended = Queued(job("old", at=50.0), queued_at=120.0, preemptions=1)
    urgent = te(1)
    queue = sorted([new_be, suspended, urgent], key=lambda q: queue_key(FITGPP, q))
    assert [q.job.job_id for q in queue] == ["urgent", "old", "new"]
    actions = decide(State(FITGPP, SIX[:2], queue, []), now=130.0)
    assert actions.start == (Placement("urgent", ("s1",)),)
    assert actions.resume == (Placement("old", ("s2",)),)


def test_fifo_never_preempts_and_keeps_arrival_order() -> None:
    fifo = Policy(PolicyName.FIFO)
    queue = [Queued(job("be", demand=2, at=1.0), 1.0), te(1)]
    assert [q.job.job_id for q in sorted(queue, key=lambda q: queue_key(fifo, q))] == [
        "be",
        "urgent",
    ]
    running = [run(job("A"), "s1", "s2", "s3", "s4", "s5")]
    actions = decide(State(fifo, SIX, queue, running), now=100.0)
    # One station free: the BE job at the head needs 2, so nothing starts, nothing is cut.
    assert actions.start == () and actions.suspend == ()


def test_lrtp_suspends_the_longest_remaining_job() -> None:
    running = [
        run(job("short", expected_run_s=200.0), "s1", "s2"),
        run(job("long", expected_run_s=9000.0), "s3", "s4"),
        run(job("mid", expected_run_s=1000.0), "s5", "s6"),
    ]
    actions = decide(State(Policy(PolicyName.LRTP, cap=None), SIX, [te(2)], running), 100.0)
    assert actions.suspend == (Suspension("long", "urgent"),)


def test_rand_is_a_seeded_draw_among_fitting_jobs() -> None:
    state = State(Policy(PolicyName.RAND, cap=None, seed=7), SIX, [te(2)], three_be())
    first = decide(state, 100.0).suspend
    assert first == decide(state, 100.0).suspend
    assert len(first) == 1 and first[0].job_id in {"A", "C"}


def test_a_station_outside_its_shift_is_never_selected() -> None:
    day_shift = (ShiftWindow.parse("06:00-18:00"),)
    stations = (Station("day", windows=day_shift), Station("always"))
    at_night = 22 * 3600.0
    pinned = Queued(job("pinned", stations=frozenset({"day"})), 0.0)
    anywhere = Queued(job("anywhere", at=1.0), 1.0)
    actions = decide(State(FITGPP, stations, [pinned, anywhere], []), now=at_night)
    # "pinned" cannot run now whatever happens: passed over, and does not block the queue.
    assert actions.start == (Placement("anywhere", ("always",)),)
    by_day = decide(State(FITGPP, stations, [pinned, anywhere], []), now=8 * 3600.0)
    assert by_day.start == (Placement("pinned", ("day",)), Placement("anywhere", ("always",)))


def test_a_shift_across_midnight_and_the_station_offset() -> None:
    night = ShiftWindow.parse("22:00-06:00")
    assert night.is_open(23 * 3600) and night.is_open(5 * 3600) and not night.is_open(12 * 3600)
    # 20:00 UTC is 23:00 at UTC+3: inside the night shift.
    station = Station("east", windows=(night,), utc_offset_s=3 * 3600)
    actions = decide(State(FITGPP, (station,), [Queued(job("j"), 0.0)], []), now=20 * 3600.0)
    assert actions.start == (Placement("j", ("east",)),)


def test_the_idle_window_opens_after_the_line_was_idle_long_enough() -> None:
    idle = (IdleWindow(600.0),)
    busy = Station("s1", windows=idle, idle_since=None)
    queue = [Queued(job("j"), 0.0)]
    assert decide(State(FITGPP, (busy,), queue, []), 1000.0).start == ()
    recently = Station("s1", windows=idle, idle_since=900.0)
    assert decide(State(FITGPP, (recently,), queue, []), 1000.0).start == ()
    long_idle = Station("s1", windows=idle, idle_since=300.0)
    assert decide(State(FITGPP, (long_idle,), queue, []), 1000.0).start == (
        Placement("j", ("s1",)),
    )


def test_a_station_leaving_its_window_mid_round_is_dropped_after_the_round() -> None:
    stations = (Station("s1", windows=(ShiftWindow.parse("06:00-18:00"),)), Station("s2"))
    running = [run(job("fleet-job", demand=2), "s1", "s2")]
    queue = [Queued(job("next", stations=frozenset({"s1"})), 0.0)]
    actions = decide(State(FITGPP, stations, queue, running), now=18 * 3600.0 + 1)
    # The job keeps the round (no suspension); s1 is not handed to anyone else.
    assert actions.drop == (StationDrop("fleet-job", "s1"),)
    assert actions.suspend == () and actions.start == ()


def test_a_team_over_its_quota_waits_and_others_go_ahead() -> None:
    queue = [Queued(job("a", team="paint", at=0.0), 0.0), Queued(job("b", at=1.0), 1.0)]
    state = State(FITGPP, SIX[:1], queue, [], team_remaining_s={"paint": 0.0, "vision": 50.0})
    assert decide(state, 10.0).start == (Placement("b", ("s1",)),)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grace_s": 0.0}, "grace period"),
        ({"grace_s": -5.0}, "grace period"),
        ({"demand": 0}, "at least 1 station"),
        ({"demand": 3, "stations": frozenset({"s1"})}, "names only 1"),
    ],
)
def test_bad_jobs_are_refused_with_a_clear_error(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "job_id": "j",
        "kind": JobKind.BE,
        "team": "vision",
        "demand": 1,
        "submitted_at": 0.0,
        "grace_s": 60.0,
    }
    with pytest.raises(SchedulerError, match=message):
        Job(**{**base, **kwargs})  # type: ignore[arg-type]


def test_bad_windows_are_refused() -> None:
    with pytest.raises(SchedulerError):
        ShiftWindow.parse("25:00-06:00")
    with pytest.raises(SchedulerError):
        ShiftWindow.parse("06:00")


def test_no_priority_overtakes_a_suspended_job() -> None:
    urgent_be = Queued(Job("vip", JobKind.BE, "vision", 1, 90.0, 60.0, priority=9), 90.0)
    suspended = Queued(job("old", at=50.0), queued_at=120.0, preemptions=1)
    queue = sorted([urgent_be, suspended], key=lambda q: queue_key(FITGPP, q))
    assert [q.job.job_id for q in queue] == ["old", "vip"]


def test_two_victims_on_one_multi_slot_station_free_one_station() -> None:
    # s1 and s2 have 2 slots each, all taken: A and B on s1, C on s2 beside D (at its cap).
    # The TE job needs 2 distinct stations. Suspending A and B frees two slots of s1 only:
    # B adds no station once A is chosen, so C is chosen instead (review finding, issue 31).
    stations = (Station("s1", slots=2), Station("s2", slots=2))
    running = [
        run(job("A", grace_s=10.0), "s1"),
        run(job("B", grace_s=20.0), "s1"),
        run(job("C", grace_s=30.0), "s2"),
        run(job("D", grace_s=5.0, max_preemptions=0), "s2"),
    ]
    actions = decide(State(FITGPP, stations, [te(2)], running), now=100.0)
    assert actions.suspend == (Suspension("A", "urgent"), Suspension("C", "urgent"))


def test_victims_on_one_station_cannot_cover_two_stations() -> None:
    stations = (Station("s1", slots=2), Station("s2", slots=1))
    running = [
        run(job("A"), "s1"),
        run(job("B"), "s1"),
        run(job("D", max_preemptions=0), "s2"),
    ]
    # Two preemptible slots, but on one station: the TE job cannot be placed; nobody is cut.
    actions = decide(State(FITGPP, stations, [te(2)], running), now=100.0)
    assert actions.suspend == ()

"""The pure parts of one incident on one page (issue 30, items 5-7): an abort's reason read
back into its criteria (as the state machine words them), conditions in words, the
actions a rollout's state allows, edges whose wave never came, the job chart's ticks and
each station's before/after, and one title per histogram bin."""

from fedge.console.conditions import Severity, alert_condition, criterion, readable
from fedge.console.histograms import BINS, Histogram
from fedge.console.incidents import tripped
from fedge.console.jobs import accuracy_chart, round_ticks, station_changes
from fedge.console.model_page import policy_words
from fedge.console.registry_views import edge_shown_state, rollout_actions
from fedge.edge_manager.rollout import machine
from fedge.edge_manager.rollout.machine import EdgeHealth, EventKind, Rollout, RolloutState
from fedge.edge_manager.rollout.plan import make_plan


def abort_reason(abort_if: str, **metrics: float) -> str:
    """The reason the real state machine records when the canary st-03 reports ``metrics``."""
    plan = make_plan(["st-01", "st-03"], canary=["st-03"], health_window="1h", abort_if=abort_if)
    rollout = Rollout(
        "r-1", "inspect:2", plan, RolloutState.PENDING, -1, machine.initial_edges(plan)
    )
    rollout = machine.apply(rollout, machine.step(rollout, {}, 100.0), 100.0)
    health = {"st-03": EdgeHealth(settled_at=101.0, metrics=metrics, passed_at=101.0)}
    step = machine.step(rollout, health, 102.0)
    assert step.state is RolloutState.ABORTED
    return next(e.detail for e in step.events if e.kind is EventKind.ABORTED)


def test_the_criteria_of_a_recorded_abort_are_read_back() -> None:
    reason = abort_reason("agreement_drop>0.05,alerts>0", agreement_drop=0.15, alerts=3.0)
    assert reason == "st-03: agreement_drop=0.15 > 0.05; st-03: alerts=3 > 0"
    drop, alerts = tripped(reason)
    assert (drop.edge, drop.metric, drop.observed, drop.op, drop.limit) == (
        "st-03",
        "agreement_drop",
        0.15,
        ">",
        0.05,
    )
    assert (alerts.metric, alerts.observed, alerts.limit) == ("alerts", 3.0, 0.0)
    (failed,) = tripped(abort_reason("failed_activation>=1", failed_activation=1.0))
    assert (failed.metric, failed.op, failed.limit) == ("failed_activation", ">=", 1.0)


def test_implicit_criteria_and_an_operators_reason_are_kept() -> None:
    (failed, timeout, operator) = tripped(
        "st-03: failed_activation=1 (a failed activation always aborts); "
        "st-04: probation_timeout (no probation verdict within 900s of activation); "
        "by operator"
    )
    assert (failed.metric, failed.observed, failed.limit) == ("failed_activation", 1.0, None)
    assert failed.note == "a failed activation always aborts"
    assert (timeout.edge, timeout.metric, timeout.observed) == ("st-04", "probation_timeout", None)
    assert timeout.note.startswith("no probation verdict")
    assert (operator.edge, operator.metric, operator.text) == ("", "", "by operator")
    assert tripped("") == []


def test_conditions_say_which_direction_is_bad() -> None:
    accuracy = alert_condition("accuracy_estimate")
    assert accuracy.severity is Severity.HIGH
    assert (
        accuracy.reading(0.61, 0.8)
        == "estimated accuracy 0.61, under the limit 0.8 (lower is worse)"
    )
    drift = alert_condition("input_drift")
    assert "higher is worse" in drift.reading(0.41, 0.2) and drift.severity is Severity.MEDIUM
    assert alert_condition("local_rollback").severity is Severity.HIGH
    assert "unknown to this console" in alert_condition("new_kind").means
    assert criterion("agreement_drop").worse == "higher"
    assert readable("rolled_back") == "rolled back" and readable("wave 2") == "wave 2"


def test_a_rollout_offers_only_what_its_state_allows() -> None:
    for state in ("pending", "canary", "wave"):
        assert rollout_actions(state) == ("pause", "abort")
    assert rollout_actions("paused") == ("resume", "abort")
    assert rollout_actions("degraded") == ("abort",)
    for finished in ("completed", "rolled_back", "aborted"):
        assert rollout_actions(finished) == ()
    assert edge_shown_state("waiting", rollout_finished=True) == (
        "not moved (the rollout ended first)"
    )
    assert edge_shown_state("waiting", rollout_finished=False) == "waiting for its wave"
    assert edge_shown_state("rolled_back", rollout_finished=True) == "rolled back"


def test_the_job_chart_has_ticks_and_each_station_its_before_and_after() -> None:
    assert round_ticks(1) == [1]
    assert round_ticks(5) == [1, 2, 3, 4, 5]
    ticks = round_ticks(30)
    assert ticks[0] == 1 and ticks[-1] == 30 and len(ticks) <= 9
    svg = accuracy_chart([(1, 0.5), (2, 0.7), (3, 0.8)])
    assert svg.count('class="tick"') == 3 + 5  # three rounds, five accuracy levels
    assert ">0.50<" in svg and ">1.00<" in svg
    changes = station_changes(
        [
            {"round": 0, "party": "st-01", "accuracy": 0.6, "examples": 40},
            {"round": 3, "party": "st-01", "accuracy": 0.72, "examples": 40},
            {"round": 0, "party": "st-02", "accuracy": 0.8, "examples": 10},
        ]
    )
    assert [(c.station, c.before, c.after, c.after_round) for c in changes] == [
        ("st-01", 0.6, 0.72, 3),
        ("st-02", 0.8, None, 0),
    ]
    assert abs((changes[0].delta or 0) - 0.12) < 1e-9 and changes[1].delta is None


def test_a_histogram_bin_says_its_count_once() -> None:
    counts = (21,) + (0,) * (BINS - 1)
    svg = Histogram("inspect:1", counts, (0,) * BINS, 0.5, 21).svg()
    assert svg.count("0.00-0.05: 21 (0 rejected)") == 1
    assert svg.count("<title>") == BINS


def test_the_gate_policy_in_words() -> None:
    words = policy_words(
        {
            "max_station_drop": 0.02,
            "min_overall_gain": 0.0,
            "min_examples": 20,
            "target_recall": 0.95,
        }
    )
    assert words[0].endswith("by more than 0.02.")
    assert "strictly better" in words[1] and "at least 20 labelled" in words[2]
    assert "95%" in words[3]
    assert policy_words({}) == []

"""Rollout plans: waves, health windows and abort criteria parsed, bad input named."""

import subprocess
import sys

import pytest

from fedge.edge_manager.rollout.plan import (
    Criterion,
    Metric,
    Op,
    RolloutError,
    RolloutPlan,
    make_plan,
    parse_criteria,
    parse_duration,
    parse_waves,
)

ISSUE_CRITERIA = (
    "agreement_drop>0.02,failed_activation>0,error_rate>0.01,latency_p95_ms>80,alerts>0,"
    "est_accuracy_drop>0.05"
)


def test_waves_are_cumulative_shares() -> None:
    assert parse_waves("25%,50%,100%") == (0.25, 0.5, 1.0)
    assert parse_waves(" 10 %, 100") == (0.1, 1.0)
    assert parse_waves("100%") == (1.0,)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("", "--waves is empty"),
        ("50%,25%,100%", "must increase"),
        ("25%,25%,100%", "must increase"),
        ("25%,50%", "must end at 100%"),
        ("0%,100%", "'0%'"),
        ("25%,150%", "'150%'"),
        ("25%,half,100%", "wave 'half'"),
        ("-10%,100%", "wave '-10%'"),
    ],
)
def test_bad_waves_are_named(text: str, named: str) -> None:
    with pytest.raises(RolloutError, match=named):
        parse_waves(text)


def test_durations() -> None:
    assert parse_duration("10m") == 600.0
    assert parse_duration("30s") == 30.0
    assert parse_duration("2h") == 7200.0
    assert parse_duration("1.5s") == 1.5
    assert parse_duration("500ms") == 0.5


@pytest.mark.parametrize("text", ["", "10", "ten minutes", "5d", "0s", "-3s", "200h"])
def test_bad_durations_are_named(text: str) -> None:
    with pytest.raises(RolloutError, match="health window"):
        parse_duration(text)


def test_every_issue_criterion_parses() -> None:
    criteria = parse_criteria(ISSUE_CRITERIA)
    assert [c.metric for c in criteria] == [
        Metric.AGREEMENT_DROP,
        Metric.FAILED_ACTIVATION,
        Metric.ERROR_RATE,
        Metric.LATENCY_P95_MS,
        Metric.ALERTS,
        Metric.EST_ACCURACY_DROP,
    ]
    assert criteria[0] == Criterion(Metric.AGREEMENT_DROP, Op.GT, 0.02)
    assert ",".join(str(c) for c in criteria) == ISSUE_CRITERIA


def test_greater_or_equal_and_spaces() -> None:
    (criterion,) = parse_criteria(" error_rate >= 0.5 ")
    assert criterion == Criterion(Metric.ERROR_RATE, Op.GE, 0.5)
    assert criterion.tripped(0.5) and not criterion.tripped(0.49)
    assert not Criterion(Metric.ERROR_RATE, Op.GT, 0.5).tripped(0.5)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("", "--abort-if is empty"),
        ("error_rte>0.01", "unknown metric 'error_rte' \\(did you mean 'error_rate'\\?\\)"),
        ("cpu>0.5", "unknown metric 'cpu'"),
        ("error_rate<0.01", "comparison '<' is not supported"),
        ("error_rate=0.01", "comparison '=' is not supported"),
        ("error_rate>lots", "'lots' is not a number"),
        ("error_rate>", "'' is not a number"),
        ("error_rate>nan", "finite number"),
        ("error_rate>-1", "finite number"),
        ("error_rate 0.01", "must look like METRIC>NUMBER"),
        ("failed_activation>0,,alerts>0", "abort criterion ''"),
        ("alerts>0,alerts>1", "name alerts twice"),
    ],
)
def test_bad_criteria_are_named(text: str, named: str) -> None:
    with pytest.raises(RolloutError, match=named):
        parse_criteria(text)


def test_plan_assigns_canary_then_cumulative_waves() -> None:
    edges = [f"st-{i:02d}" for i in range(1, 10)]
    plan = make_plan(edges, canary=["st-03"], waves="25%,50%,100%", health_window="2s")
    waves: dict[int, list[str]] = {}
    for edge, wave in plan.assignment():
        waves.setdefault(wave, []).append(edge)
    # 8 non-canary edges: ceil(2) = 2, ceil(4) = 4, 8.
    assert waves == {
        0: ["st-03"],
        1: ["st-01", "st-02"],
        2: ["st-04", "st-05"],
        3: ["st-06", "st-07", "st-08", "st-09"],
    }
    assert (
        plan.assignment()
        == make_plan(
            list(reversed(edges)), canary=["st-03"], waves="25%,50%,100%", health_window="2s"
        ).assignment()
    )


def test_small_fleets_skip_empty_waves() -> None:
    plan = make_plan(["a-1", "a-2"], canary=["a-1"], waves="25%,50%,100%")
    assert plan.assignment() == (("a-1", 0), ("a-2", 1))


def test_plan_round_trips_through_its_stored_form() -> None:
    plan = make_plan(
        ["st-02", "st-01"],
        canary=["st-01"],
        waves="50%,100%",
        health_window="10m",
        abort_if=ISSUE_CRITERIA,
    )
    assert RolloutPlan.from_json_dict(plan.to_json_dict()) == plan
    assert plan.edges == ("st-01", "st-02") and plan.health_window_s == 600.0


@pytest.mark.parametrize(
    ("edges", "canary", "named"),
    [
        ([], [], "at least one target edge"),
        (["st-01", "st-01"], [], "edges named twice: st-01"),
        (["st-01"], ["st-01", "st-01"], "canary edges named twice"),
        (["st-01", "st-02"], ["st-09"], "canary edge\\(s\\) st-09 are not among"),
    ],
)
def test_bad_plans_are_named(edges: list[str], canary: list[str], named: str) -> None:
    with pytest.raises(RolloutError, match=named):
        make_plan(edges, canary=canary)


def test_a_damaged_stored_plan_is_named() -> None:
    with pytest.raises(RolloutError, match="stored rollout plan is damaged"):
        RolloutPlan.from_json_dict({"edges": ["st-01"]})


def test_the_timeouts_are_part_of_the_plan_and_old_stored_plans_get_the_defaults() -> None:
    plan = make_plan(["st-01"], activation_timeout="90s", rollback_timeout="2m")
    assert (plan.activation_timeout_s, plan.rollback_timeout_s) == (90.0, 120.0)
    assert RolloutPlan.from_json_dict(plan.to_json_dict()) == plan
    defaults = make_plan(["st-01"])
    assert (defaults.activation_timeout_s, defaults.rollback_timeout_s) == (600.0, 600.0)
    stored_before = {
        "edges": ["st-01"],
        "canary": [],
        "waves": [1.0],
        "health_window_s": 600.0,
        "abort_if": ["failed_activation>0"],
    }
    assert RolloutPlan.from_json_dict(stored_before) == defaults
    with pytest.raises(RolloutError, match="activation timeout 'soon' is not a duration"):
        make_plan(["st-01"], activation_timeout="soon")
    with pytest.raises(RolloutError, match="rollback timeout '0s' must be longer than 0"):
        make_plan(["st-01"], rollback_timeout="0s")


def test_waiting_for_the_stations_verdicts_is_the_default_and_is_stored() -> None:
    defaults = make_plan(["st-01"])
    assert defaults.wait_for_probation and defaults.probation_timeout_s == 900.0
    plan = make_plan(["st-01"], wait_for_probation=False, probation_timeout="2m")
    assert (plan.wait_for_probation, plan.probation_timeout_s) == (False, 120.0)
    assert RolloutPlan.from_json_dict(plan.to_json_dict()) == plan
    with pytest.raises(RolloutError, match="probation timeout '0s' must be longer than 0"):
        make_plan(["st-01"], probation_timeout="0s")
    stored = {**defaults.to_json_dict(), "wait_for_probation": "yes"}
    with pytest.raises(RolloutError, match="damaged"):
        RolloutPlan.from_json_dict(stored)


@pytest.mark.parametrize(
    "damaged",
    [
        {"edges": "st-01", "canary": [], "waves": [1.0], "health_window_s": 1, "abort_if": []},
        {"edges": ["st-01"], "canary": [], "waves": [1.0], "health_window_s": "1", "abort_if": []},
        {"edges": ["st-01"], "canary": [], "waves": ["x"], "health_window_s": 1, "abort_if": []},
        {
            "edges": ["st-01"],
            "canary": [],
            "waves": [1.0],
            "health_window_s": 1,
            "abort_if": ["failed_activation>0"],
            "rollback_timeout_s": None,
        },
    ],
)
def test_damaged_stored_plans_are_refused_without_assert(damaged: dict[str, object]) -> None:
    with pytest.raises(RolloutError, match="stored rollout plan is damaged"):
        RolloutPlan.from_json_dict(damaged)


@pytest.mark.integration
def test_a_damaged_stored_plan_is_refused_under_python_dash_o_too() -> None:
    # Validation by `assert` vanishes under -O: the damaged plan would decode.
    code = (
        "from fedge.edge_manager.rollout.plan import RolloutPlan, RolloutError\n"
        "try:\n"
        "    RolloutPlan.from_json_dict({'edges': 'st-01', 'canary': [], 'waves': [1.0],"
        " 'health_window_s': 1, 'abort_if': ['failed_activation>0']})\n"
        "except RolloutError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and "refused: a stored rollout plan is damaged" in done.stdout, (
        done.stdout + done.stderr
    )


@pytest.mark.parametrize(
    "text", ["failed_activation>=0", "alerts>=0", "error_rate>=0", "latency_p95_ms>=0"]
)
def test_criteria_that_always_hold_are_refused(text: str) -> None:
    name = text.split(">")[0]
    with pytest.raises(RolloutError, match=f"always holds \\({name} is never below 0\\)"):
        parse_criteria(text)


def test_a_drop_may_be_compared_with_zero() -> None:
    # A drop can be negative (the new model better), so >= 0 is a real criterion.
    (criterion,) = parse_criteria("agreement_drop>=0")
    assert not criterion.tripped(-0.01) and criterion.tripped(0.0)

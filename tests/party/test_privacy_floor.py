"""The station's privacy floor: the pure decision, and the ledger that holds it (issue 24).

The decision is a function of frozen dataclasses (floor x requested spec); the ledger
tests use a real SQLite file. The manager's budget may tighten the floor, never loosen or
clear it.
"""

import tomllib
from pathlib import Path

import pytest

from fedge.party.budget import BudgetLedger, lifetime_bound
from fedge.privacy import accounting
from fedge.privacy.floor import (
    EvaluationBudget,
    PrivacyFloor,
    PrivacyFloorError,
    default_floor,
    effective_spec,
    floor_toml,
    lifetime_refusal,
    noisy_accuracy,
    plan_refusal,
    round_refusal,
)
from fedge.privacy.settings import (
    BudgetExhaustedError,
    DpRelease,
    PrivacyError,
    PrivacyMode,
    PrivacySpec,
)

FLOOR = PrivacyFloor(job_epsilon=4.0, lifetime_epsilon=10.0, delta=1e-5, min_noise_multiplier=0.8)
LOCAL = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=4.0, delta=1e-5)


# ---------------------------------------------------------------- the pure decision


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (PrivacySpec(), "dp-mode 'none'"),
        (PrivacySpec(mode=PrivacyMode.CENTRAL, noise_multiplier=1.0), "dp-mode 'central'"),
        (PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=0.3), "noise multiplier 0.3"),
        (PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=8.0), "asks for epsilon 8"),
    ],
)
def test_a_round_asking_for_less_than_the_floor_is_refused_naming_it(
    spec: PrivacySpec, named: str
) -> None:
    reason = round_refusal(FLOOR, spec)
    assert reason is not None and named in reason
    assert "the station's privacy floor (DP-SGD, epsilon <= 4 per job and 10" in reason


@pytest.mark.parametrize(
    "spec",
    [
        LOCAL,
        PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=2.0, delta=1e-3),
        PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=0.8),
        PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=4.0, secagg=True),
    ],
)
def test_a_round_within_the_floor_is_admitted(spec: PrivacySpec) -> None:
    assert round_refusal(FLOOR, spec) is None


def test_no_floor_admits_anything() -> None:
    assert round_refusal(None, PrivacySpec()) is None
    assert plan_refusal(None, DpRelease(0.1, 0.5, 3)) is None
    assert lifetime_refusal(None, 1e9) is None
    assert effective_spec(None, LOCAL) is LOCAL


def test_the_planned_noise_and_the_lifetime_are_judged_against_the_floor() -> None:
    below = plan_refusal(FLOOR, DpRelease(0.5, 0.25, 8))
    assert below is not None and "noise multiplier 0.5" in below
    assert plan_refusal(FLOOR, DpRelease(0.8, 0.25, 8)) is None
    past = lifetime_refusal(FLOOR, 10.5)
    assert past is not None and "lifetime epsilon 10.5" in past
    assert lifetime_refusal(FLOOR, 10.0) is None


def test_the_station_plans_at_its_smaller_delta_and_bounds_a_noise_only_job() -> None:
    loose = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=2.0, delta=1e-3)
    assert effective_spec(FLOOR, loose) == PrivacySpec(
        mode=PrivacyMode.LOCAL, epsilon=2.0, delta=1e-5
    )
    fixed = PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=1.0)
    assert effective_spec(FLOOR, fixed).epsilon == FLOOR.job_epsilon  # the job's bound here


def test_the_default_floor_keeps_delta_below_a_tenth_of_one_over_the_images_kept() -> None:
    for keep in (1, 100, 3000, 5000, 123_456):
        floor = default_floor(keep)
        assert floor.delta <= 1 / (10 * keep)
        assert floor.delta > 1 / (100 * keep)  # rounded down one digit, not to nothing
    assert default_floor(5000).delta == 2e-5
    assert default_floor(5000).mode is PrivacyMode.LOCAL


def test_the_floor_in_agent_toml_reads_back_as_written() -> None:
    floor = default_floor(3000)
    document = tomllib.loads("\n".join([*floor_toml(floor), "http_port = 1", ""]))
    assert PrivacyFloor.from_table(document["privacy_floor"]) == floor
    assert document["http_port"] == 1  # an inline table: later keys stay top-level
    opted_out = tomllib.loads("\n".join(floor_toml(None)))
    assert opted_out == {"privacy_floor": "none"}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"mode": "none"}, "opts out of the floor"),
        ({"mode": "central"}, "must be 'local'"),
        ({"job_epsilon": 0}, "job_epsilon must be a number > 0"),
        ({"job_epsilon": 20.0}, "above its lifetime_epsilon"),
        ({"delta": 1.0}, "delta must be in (0, 1)"),
        ({"evaluations_per_job": 1.5}, "whole number"),
        ({"epsilon": 1.0}, "unknown setting privacy_floor.epsilon"),
        ({"delta": "small"}, "must be a number"),
    ],
)
def test_a_bad_floor_is_refused_saying_which_setting(
    table: dict[str, object], message: str
) -> None:
    with pytest.raises(PrivacyError) as refused:
        PrivacyFloor.from_table(table)
    assert message in str(refused.value)


def test_an_evaluation_is_a_gaussian_count_limited_per_job() -> None:
    budget = EvaluationBudget(per_job=2, noise=20.0)
    assert budget.release() == DpRelease(20.0, 1.0, 1)
    assert budget.refusal(1, "job-a") is None
    refusal = budget.refusal(2, "job-a")
    assert refusal is not None and "evaluations_per_job = 2" in refusal
    assert noisy_accuracy(50, 100, 3.0) == pytest.approx(0.53)
    assert noisy_accuracy(99, 100, 40.0) == 1.0  # clipped: post-processing
    assert noisy_accuracy(1, 100, -40.0) == 0.0


# ---------------------------------------------------------------- the ledger


def ledger(tmp_path: Path) -> BudgetLedger:
    return BudgetLedger(tmp_path / "privacy.db")


def test_the_manager_tightens_the_floor_and_never_loosens_or_clears_it(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    try:
        assert book.floor_state() == (False, None)
        book.set_floor(FLOOR)
        assert book.floor_state() == (True, FLOOR)
        assert (book.bound().epsilon, book.bound().delta) == (10.0, 1e-5)
        book.set_lifetime(4.0, 1e-3)  # tighter epsilon, looser delta
        assert (book.bound().epsilon, book.bound().delta) == (4.0, 1e-5)
        book.set_lifetime(100.0, 1e-2)  # looser: the floor holds
        assert (book.bound().epsilon, book.bound().delta) == (10.0, 1e-5)
        book.set_lifetime(None, 1e-3)  # `set-privacy --clear`: the floor holds
        assert book.bound().epsilon == 10.0 and book.bound().from_floor
        book.set_floor(None)  # the station's own operator opted out
        assert book.floor_state() == (True, None)
        assert book.bound().epsilon is None
    finally:
        book.close()
    assert lifetime_bound((3.0, 1e-3), FLOOR).epsilon == 3.0


def test_a_round_past_the_floors_lifetime_is_refused_naming_the_floor(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    round_ = DpRelease(1.0, 0.25, 8)
    one = accounting.epsilon_spent([round_], 1e-5)
    floor = PrivacyFloor(job_epsilon=one * 1.05, lifetime_epsilon=one * 1.05, delta=1e-5)
    try:
        book.set_floor(floor)
        book.reserve("job-a", 1, round_, attempt="a", job_epsilon=None, delta=1e-5)
        with pytest.raises(BudgetExhaustedError) as refused:
            book.reserve("job-b", 1, round_, attempt="b", job_epsilon=None, delta=1e-5)
        message = str(refused.value)
        assert "the station's privacy floor" in message
        assert "the manager cannot" in message
        assert book.history() == [round_]  # the refused round was not recorded
    finally:
        book.close()


def test_evaluations_are_counted_per_job_and_in_the_lifetime(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    budget = EvaluationBudget(per_job=2, noise=20.0)
    try:
        book.set_floor(FLOOR)
        book.record_evaluation("job-a", budget)
        book.record_evaluation("job-a", budget)
        with pytest.raises(PrivacyFloorError, match="evaluations_per_job = 2"):
            book.record_evaluation("job-a", budget)
        book.record_evaluation("job-b", budget)  # another job has its own count
        assert len(book.evaluations("job-a")) == 2 and len(book.evaluations()) == 3
        assert book.history() == []  # not training releases...
        assert book.spent("job-a", delta=1e-5) == 0.0  # ...nor the job's training spend
        assert book.spent(None, delta=1e-5) == pytest.approx(
            accounting.epsilon_spent([budget.release()] * 3, 1e-5), rel=1e-9
        )  # ...but the lifetime's
    finally:
        book.close()


def test_an_evaluation_past_the_lifetime_is_refused_and_not_counted(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    budget = EvaluationBudget(per_job=10, noise=1.0)
    try:
        one = accounting.epsilon_spent([budget.release()], 1e-5)
        book.set_floor(PrivacyFloor(job_epsilon=one * 1.2, lifetime_epsilon=one * 1.2))
        book.record_evaluation("job-a", budget)
        with pytest.raises(BudgetExhaustedError, match="this evaluation would make it"):
            book.record_evaluation("job-a", budget)
        assert len(book.evaluations()) == 1
    finally:
        book.close()

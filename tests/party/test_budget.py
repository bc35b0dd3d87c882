"""The privacy ledger: refuses past the job's and the lifetime bound, survives restarts."""

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fedge.party.budget import BudgetLedger
from fedge.privacy.accounting import epsilon_spent, plan_round
from fedge.privacy.settings import (
    BudgetExhaustedError,
    DpRelease,
    PrivacyError,
    PrivacyMode,
    PrivacySpec,
)

DELTA = 1e-3
ROUND = DpRelease(noise_multiplier=1.0, sample_rate=0.1, steps=20)


@pytest.mark.slow
def test_a_job_trains_its_planned_rounds_then_refuses(tmp_path: Path) -> None:
    spec = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=3.0, delta=DELTA, rounds_per_party=3)
    release = plan_round(spec, examples=200, batch_size=20, epochs=1, planned_rounds=3)
    ledger = BudgetLedger(tmp_path / "privacy.db")
    for server_round in (1, 2, 3):
        ledger.check("job-a", release, job_epsilon=3.0, delta=DELTA)
        assert ledger.record("job-a", server_round, release)
    assert ledger.spent("job-a", delta=DELTA) == pytest.approx(
        epsilon_spent([release] * 3, DELTA), rel=1e-12
    )
    with pytest.raises(BudgetExhaustedError) as refused:
        ledger.check("job-a", release, job_epsilon=3.0, delta=DELTA)
    message = str(refused.value)
    assert "job 'job-a'" in message
    assert f"spent epsilon = {ledger.spent('job-a', delta=DELTA):.4g}" in message
    assert "above the job's epsilon = 3" in message
    # Another job has its own bound (no lifetime bound is set).
    ledger.check("job-b", release, job_epsilon=3.0, delta=DELTA)
    # Without a job bound nothing refuses.
    ledger.check("job-a", release, job_epsilon=None, delta=DELTA)
    ledger.close()


def test_a_plan_landing_exactly_on_the_bound_is_allowed(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "privacy.db")
    ledger.record("job", 1, ROUND)
    exactly = epsilon_spent([ROUND, ROUND], DELTA)
    ledger.check("job", ROUND, job_epsilon=exactly, delta=DELTA)
    with pytest.raises(BudgetExhaustedError):
        ledger.check("job", ROUND, job_epsilon=exactly * (1 - 1e-4), delta=DELTA)


def test_the_lifetime_bound_composes_every_job(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "privacy.db")
    assert ledger.lifetime() == (None, 1e-3)
    # Composition is sublinear: the bound sits between two and three rounds' epsilon.
    bound = (epsilon_spent([ROUND] * 2, 1e-5) + epsilon_spent([ROUND] * 3, 1e-5)) / 2
    ledger.set_lifetime(bound, 1e-5)
    assert ledger.lifetime() == (bound, 1e-5)
    ledger.check("job-a", ROUND, job_epsilon=None, delta=DELTA)
    ledger.record("job-a", 1, ROUND)
    ledger.check("job-b", ROUND, job_epsilon=100.0, delta=DELTA)
    ledger.record("job-b", 1, ROUND)
    assert len(ledger.history()) == 2
    assert ledger.history("job-b") == [ROUND]
    assert ledger.spent(delta=1e-5) == pytest.approx(epsilon_spent([ROUND] * 2, 1e-5))
    with pytest.raises(BudgetExhaustedError) as refused:
        ledger.check("job-c", ROUND, job_epsilon=100.0, delta=DELTA)
    message = str(refused.value)
    assert "lifetime privacy budget exhausted" in message
    assert "(delta = 1e-05)" in message  # accounted at the lifetime delta, not the job's
    assert "fedge edge set-privacy EDGE --epsilon" in message
    # Raising the lifetime bound (the operator's signed edge config) lets it train again.
    ledger.set_lifetime(2 * bound, 1e-5)
    ledger.check("job-c", ROUND, job_epsilon=100.0, delta=DELTA)
    ledger.set_lifetime(None, 1e-5)
    assert ledger.lifetime() == (None, 1e-5)


def test_refusal_survives_closing_and_reopening(tmp_path: Path) -> None:
    path = tmp_path / "station" / "privacy.db"
    ledger = BudgetLedger(path)
    ledger.set_lifetime(
        (epsilon_spent([ROUND], DELTA) + epsilon_spent([ROUND] * 2, DELTA)) / 2, DELTA
    )
    ledger.record("job", 1, ROUND)
    ledger.close()
    reopened = BudgetLedger(path)
    assert reopened.history("job") == [ROUND]
    for _ in range(2):
        with pytest.raises(BudgetExhaustedError, match="lifetime"):
            reopened.check("job", ROUND, job_epsilon=None, delta=DELTA)
    reopened.close()


def test_an_attempt_is_recorded_once_and_every_attempt_counts(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "privacy.db")
    assert ledger.record("job", 4, ROUND, attempt="a1")
    assert not ledger.record("job", 4, DpRelease(2.0, 0.2, 5), attempt="a1")
    assert ledger.record("job", 4, ROUND, attempt="a2")  # trained again after a crash
    assert ledger.record("job", 5, ROUND)
    assert ledger.record("other-job", 4, ROUND)
    assert ledger.history("job") == [ROUND, ROUND, ROUND]
    with pytest.raises(PrivacyError, match="needs its job's id"):
        ledger.record("", 1, ROUND)


@pytest.mark.integration
def test_a_release_recorded_before_a_sigkill_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "privacy.db"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from fedge.privacy.settings import DpRelease\n"
            "from fedge.party.budget import BudgetLedger\n"
            "ledger = BudgetLedger(Path(sys.argv[1]))\n"
            "ledger.record('job', 7, DpRelease(1.0, 0.1, 20))\n"
            "print('recorded', flush=True)\n"
            "time.sleep(60)\n",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "recorded"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()
    ledger = BudgetLedger(path)
    assert ledger.history() == [ROUND]
    assert not ledger.record("job", 7, ROUND)  # the same attempt is not counted twice
    ledger.close()


def test_a_file_that_is_not_a_ledger_is_a_clear_error(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite at all, just bytes " * 100)
    with pytest.raises(PrivacyError, match="is not a privacy ledger"):
        BudgetLedger(garbage)
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE dp_releases (something TEXT)")
    conn.close()
    with pytest.raises(PrivacyError, match="not a privacy ledger's"):
        BudgetLedger(foreign)
    with pytest.raises(PrivacyError, match="cannot open the privacy ledger"):
        BudgetLedger(garbage / "under-a-file.db")


@pytest.mark.parametrize(
    ("epsilon", "delta", "match"),
    [
        (0.0, 1e-3, "epsilon must be > 0"),
        (-1.0, 1e-3, "epsilon must be > 0"),
        (float("inf"), 1e-3, "epsilon must be > 0"),
        (8.0, 1.0, r"delta must be in \(0, 1\)"),
        (8.0, 0.0, r"delta must be in \(0, 1\)"),
    ],
)
def test_a_nonsense_lifetime_bound_is_refused(
    tmp_path: Path, epsilon: float, delta: float, match: str
) -> None:
    ledger = BudgetLedger(tmp_path / "privacy.db")
    with pytest.raises(PrivacyError, match=match):
        ledger.set_lifetime(epsilon, delta)
    assert ledger.lifetime() == (None, 1e-3)  # nothing changed
    ledger.close()


def test_two_trainings_cannot_both_pass_a_check_only_one_fits(tmp_path: Path) -> None:
    """reserve() checks and records in one transaction: of two racing trainings on one
    ledger (two jobs, two ClientApp processes) only one gets the last of the budget."""
    import threading

    path = tmp_path / "privacy.db"
    one = epsilon_spent([ROUND], DELTA)
    two = epsilon_spent([ROUND, ROUND], DELTA)
    setup = BudgetLedger(path)
    setup.set_lifetime((one + two) / 2, DELTA)  # room for one round, not two
    setup.close()
    outcomes: list[str] = []
    start = threading.Barrier(2)

    def train(job: str) -> None:
        ledger = BudgetLedger(path)  # its own connection, as a second process would have
        try:
            start.wait()
            ledger.reserve(job, 1, ROUND, attempt=job, job_epsilon=None, delta=DELTA)
            outcomes.append("trained")
        except BudgetExhaustedError:
            outcomes.append("refused")
        finally:
            ledger.close()

    threads = [threading.Thread(target=train, args=(f"job-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["refused", "trained"]
    check = BudgetLedger(path)
    try:
        assert check.spent(None, delta=DELTA) == pytest.approx(one, rel=1e-12)
    finally:
        check.close()


def test_a_reservation_is_settled_to_what_training_took_or_cancelled(tmp_path: Path) -> None:
    ledger = BudgetLedger(tmp_path / "privacy.db")
    try:
        ledger.reserve("job", 1, ROUND, attempt="a", job_epsilon=None, delta=DELTA)
        shorter = DpRelease(ROUND.noise_multiplier, ROUND.sample_rate, 5)  # stopped early
        ledger.settle("job", 1, "a", shorter)
        assert ledger.history("job") == [shorter]
        ledger.reserve("job", 2, ROUND, attempt="b", job_epsilon=None, delta=DELTA)
        ledger.cancel("job", 2, "b")  # training failed: nothing left the party
        assert ledger.history("job") == [shorter]
        with pytest.raises(PrivacyError, match="needs its job's id"):
            ledger.reserve("", 3, ROUND, attempt="c", job_epsilon=None, delta=DELTA)
    finally:
        ledger.close()


def test_a_shared_ledger_stays_open_and_a_replaced_file_is_opened_afresh(tmp_path: Path) -> None:
    from fedge.party import budget

    path = tmp_path / "privacy.db"
    first = budget.shared(path)
    assert budget.shared(path) is first  # kept open: no checkpoint on close every round
    first.reserve("job-a", 1, ROUND, attempt="a", job_epsilon=None, delta=DELTA)
    # Another process sees the reservation at once (it is committed, FULL sync).
    assert BudgetLedger(path).history("job-a") == [ROUND]
    # A restore puts another file in its place: the shared ledger follows the new file.
    other = tmp_path / "restored.db"
    BudgetLedger(other).close()
    os.replace(other, path)
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    again = budget.shared(path)
    assert again is not first
    assert again.history("job-a") == []
    again.reserve("job-a", 2, ROUND, attempt="b", job_epsilon=None, delta=DELTA)
    assert BudgetLedger(path).history("job-a") == [ROUND]

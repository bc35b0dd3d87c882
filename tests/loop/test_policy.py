"""The continuous-training trigger and the run's states (pure)."""

import pytest

from fedge.loop.pipeline import (
    Gated,
    JobFailed,
    LoopRun,
    PipelineError,
    Published,
    RolloutEnded,
    RolloutStarted,
    RunState,
    StepFailed,
    advance,
)
from fedge.loop.policy import LoopPolicy, LoopPolicyError, Observation, alert_kinds, decide

JOB = '[job]\nname = "x"\n'


def policy(**kw: object) -> LoopPolicy:
    base: dict[str, object] = {"model": "inspect", "job": JOB, "min_new_labels": 200}
    base.update(kw)
    return LoopPolicy(**base)  # type: ignore[arg-type]


def seen(**kw: object) -> Observation:
    base: dict[str, object] = {
        "new_labels": 0,
        "open_alerts": (),
        "running": False,
        "last_started_at": None,
    }
    base.update(kw)
    return Observation(**base)  # type: ignore[arg-type]


def test_enough_new_labels_start_a_run() -> None:
    assert not decide(policy(), seen(new_labels=199), 0.0).start
    decision = decide(policy(), seen(new_labels=200), 0.0)
    assert decision.start and "200 new labels" in decision.reason


def test_a_triggering_alert_starts_a_run_and_names_it() -> None:
    p = policy(on_alerts=alert_kinds(["drift"]))
    decision = decide(p, seen(open_alerts=(("st-02", "input_drift"),)), 0.0)
    assert decision.start and decision.reason == "alert: input_drift at st-02"
    # An alert kind the policy does not name does not trigger.
    assert not decide(p, seen(open_alerts=(("st-02", "accuracy_estimate"),)), 0.0).start


def test_no_second_run_while_one_runs_or_during_the_cooldown() -> None:
    p = policy(cooldown_s=600.0)
    assert not decide(p, seen(new_labels=500, running=True), 0.0).start
    cooling = decide(p, seen(new_labels=500, last_started_at=100.0), 400.0)
    assert not cooling.start and "cooling down (300s left)" in cooling.reason
    assert decide(p, seen(new_labels=500, last_started_at=100.0), 700.0).start
    assert not decide(policy(enabled=False), seen(new_labels=500), 0.0).start


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"min_new_labels": -1}, "--min-new-labels"),
        ({"min_new_labels": 0}, "never trigger"),
        ({"on_alerts": frozenset({"fire"})}, "unknown alert kind"),
        ({"model": "bad name"}, "not a registry model name"),
        ({"job": "  "}, "fleet job manifest"),
        ({"cooldown_s": -5.0}, "--cooldown"),
    ],
)
def test_bad_policies_are_refused(kw: dict[str, object], fragment: str) -> None:
    with pytest.raises(LoopPolicyError, match=fragment):
        policy(**kw)


def test_alert_kind_names() -> None:
    assert alert_kinds(["drift,accuracy_estimate"]) == {
        "input_drift",
        "score_drift",
        "accuracy_estimate",
    }
    with pytest.raises(LoopPolicyError, match="unknown alert kind 'dirft'"):
        alert_kinds(["dirft"])


def run() -> LoopRun:
    return LoopRun("r1", "inspect", RunState.TRAINING, "test", 0.0, 0.0, job_dir="/j")


def test_a_run_goes_from_training_to_completed() -> None:
    r = advance(run(), Published("inspect:5"), 1.0)
    assert (r.state, r.candidate) == (RunState.GATING, "inspect:5")
    r = advance(r, Gated(True, ""), 2.0)
    r = advance(r, RolloutStarted("ro-1"), 3.0)
    assert (r.state, r.rollout_id) == (RunState.ROLLING_OUT, "ro-1")
    r = advance(r, RolloutEnded(True, ""), 4.0)
    assert r.state is RunState.COMPLETED and r.updated_at == 4.0


def test_a_run_ends_at_the_step_that_says_no() -> None:
    assert advance(run(), JobFailed("no parties"), 1.0).state is RunState.FAILED
    gated = advance(run(), Published("inspect:5"), 1.0)
    refused = advance(gated, Gated(False, "worse on st-02"), 2.0)
    assert (refused.state, refused.reason) == (RunState.NOT_BLESSED, "worse on st-02")
    rolling = advance(advance(gated, Gated(True, ""), 2.0), RolloutStarted("ro-1"), 3.0)
    back = advance(rolling, RolloutEnded(False, "canary st-03: agreement_drop 0.2 > 0.02"), 4.0)
    assert back.state is RunState.ROLLED_BACK and "canary" in back.reason
    assert advance(rolling, StepFailed("refused"), 5.0).state is RunState.FAILED


def test_events_that_do_not_fit_the_state_are_refused() -> None:
    with pytest.raises(PipelineError, match="Gated does not fit"):
        advance(run(), Gated(True, ""), 1.0)
    ended = advance(run(), JobFailed("x"), 1.0)
    with pytest.raises(PipelineError, match="already ended"):
        advance(ended, Published("inspect:5"), 2.0)

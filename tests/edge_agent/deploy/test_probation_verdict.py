"""A new model's probation verdict (pure) and the thresholds in force for a model (pure)."""

import math
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedge.edge_agent.config.decisions import ThresholdSource, decide, thresholds_in_force
from fedge.edge_agent.deploy import probation_verdict as health
from fedge.edge_agent.deploy import restore, served
from fedge.edge_agent.deploy.probation import KEY, Probation, Trial, decode_trial, encode_trial
from fedge.edge_agent.deploy.probation_verdict import Outcome, ProbationPolicy, Verdict, Window
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.inference.runtime import LoadedModel
from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.store import LocalStore
from fedge.models.tiny_onnx import build_linear_classifier
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ValidationError
from fedge.protocols.manifest import ModelManifest, TensorSpec, Thresholds

POLICY = ProbationPolicy(images=10, seconds=60.0, min_images=4, max_error_rate=0.1)
VARIED = tuple(0.1 * i for i in range(10))


def _window(n: int = 10, *, latency: float = 1.0, scores: tuple[float, ...] = VARIED) -> Window:
    return health.observe(Window(), latencies_ms=[latency] * n, defect_scores=scores[:n])


# ---------------------------------------------------------------- probation verdicts


def test_a_good_model_passes_once_the_window_is_full() -> None:
    assert health.judge(POLICY, _window(9), 1.0, 5.0, 0.2).outcome is Outcome.PENDING
    verdict = health.judge(POLICY, _window(10), 1.0, 5.0, 0.2)
    assert verdict == Verdict(Outcome.PASSED, images=10, note="passed over 10 image(s)")


def test_latency_over_the_budget_fails_with_the_p95_and_the_budget() -> None:
    latencies = [1.0] * 9 + [9.0]  # p95 of ten values, nearest rank, is the largest
    window = health.observe(Window(), latencies_ms=latencies, defect_scores=VARIED)
    verdict = health.judge(POLICY, window, 1.0, 5.0, None)
    assert (verdict.outcome, verdict.check, verdict.measured, verdict.limit) == (
        Outcome.FAILED,
        "latency",
        9.0,
        5.0,
    )
    assert verdict.reason == "latency: p95 9 ms > budget 5 ms over 10 image(s)"
    # No budget in the manifest: no latency check.
    assert health.judge(POLICY, window, 1.0, None, None).outcome is Outcome.PASSED


def test_inference_errors_fail_as_soon_as_the_window_cannot_pass() -> None:
    # One error is within 10% of ten images; two can never be: decided at once.
    one = health.observe(Window(), errors=1)
    assert health.judge(POLICY, one, 0.0, None, None).outcome is Outcome.PENDING
    two = health.observe(one, errors=1)
    verdict = health.judge(POLICY, two, 0.0, None, None)
    assert (verdict.outcome, verdict.check, verdict.measured, verdict.limit) == (
        Outcome.FAILED,
        "inference_errors",
        1.0,
        0.1,
    )
    assert "2 of 2 image(s) failed to score (rate 1.000 > limit 0.1)" in verdict.reason


def test_a_nan_score_fails_at_once() -> None:
    rows = np.array([[0.5, 0.5], [math.nan, 0.2], [0.3, 0.7]], dtype=np.float32)
    scores, non_finite = health.defect_scores(rows, health.defect_indices(("ok", "bad"), ()))
    assert ([round(v, 6) for v in scores], non_finite) == ([0.5, 0.7], 1)
    window = health.observe(Window(), latencies_ms=[1.0] * 3, defect_scores=scores, non_finite=1)
    verdict = health.judge(POLICY, window, 0.0, None, None)
    assert (verdict.check, verdict.measured, verdict.limit) == ("non_finite_scores", 1.0, 0.0)


def test_collapsed_scores_fail_only_where_the_previous_model_varied() -> None:
    flat = _window(scores=(0.02,) * 10)
    verdict = health.judge(POLICY, flat, 1.0, None, baseline_spread=0.25)
    assert (verdict.outcome, verdict.check, round(verdict.measured, 9), verdict.limit) == (
        Outcome.FAILED,
        "scores_collapsed",
        0.0,
        0.001,
    )
    assert "(the previous model's: 0.25)" in verdict.reason
    # A previous model as steady (a line of identical good parts), or no baseline: passes.
    assert health.judge(POLICY, flat, 1.0, None, 0.0001).outcome is Outcome.PASSED
    assert health.judge(POLICY, flat, 1.0, None, None).outcome is Outcome.PASSED


def test_the_time_limit_ends_probation_and_too_few_images_pass() -> None:
    assert health.judge(POLICY, _window(5), 59.0, None, None).outcome is Outcome.PENDING
    slow = health.judge(POLICY, _window(5, latency=9.0), 60.0, 5.0, None)
    assert (slow.outcome, slow.check, slow.images) == (Outcome.FAILED, "latency", 5)
    few = health.judge(POLICY, _window(3, latency=9.0), 60.0, 5.0, None)
    assert few.outcome is Outcome.PASSED and "too few to judge" in few.reason


def test_defect_scores_take_the_highest_positive_class() -> None:
    rows = np.array([[0.1, 0.6, 0.3], [0.7, 0.1, 0.2]])
    assert health.defect_indices(("ok", "scratch", "dent"), ("dent",)) == (2,)
    assert health.defect_scores(rows, (1, 2))[0] == [0.6, 0.2]
    assert health.defect_scores(np.empty((0, 0)), (1,)) == ([], 0)
    assert health.p95([3.0, 1.0, 2.0]) == 3.0
    assert health.spread([0.5]) == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("images", 0),
        ("seconds", 0.0),
        ("min_images", 11),
        ("max_error_rate", 1.0),
        ("min_spread", -0.1),
    ],
)
def test_a_bad_probation_policy_is_refused(field: str, value: float) -> None:
    args: dict[str, float] = {"images": 10, field: value}
    with pytest.raises(ValidationError, match=field.replace("seconds", "probation_s")):
        ProbationPolicy(**args)  # type: ignore[arg-type]


def test_agent_settings_carry_sane_probation_defaults() -> None:
    settings = AgentSettings(
        fleet="f",
        edge="e",
        data_dir=Path("/tmp/x"),
        broker_host="h",
        broker_port=1,
        insecure=True,
        password="p",
        grpc_target="h:2",
        manager_public_key="k",
    )
    assert settings.probation_policy() == ProbationPolicy()


# ---------------------------------------------------------------- thresholds in force


def _manifest(version: int, thresholds: Thresholds | None = None) -> ModelManifest:
    return ModelManifest(
        name="inspect",
        version=version,
        sha256="0" * 64,
        size=1,
        inputs=(TensorSpec("image", "float32", ("batch", 1, 32, 32)),),
        outputs=(TensorSpec("probs", "float32", ("batch", 2)),),
        classes=("clean", "scratch"),
        positive_classes=("scratch",),
        thresholds=thresholds,
    )


def _config(model: str | None) -> EdgeConfig:
    return EdgeConfig(
        fleet="f",
        edge="e",
        version=3,
        default_threshold=0.6,
        class_thresholds={"scratch": 0.7},
        model=model,
    )


RECOMMENDED = Thresholds(0.4, {"scratch": 0.35})


def test_a_config_for_the_serving_model_or_for_any_applies() -> None:
    for model in ("inspect:1", None):
        in_force = thresholds_in_force(_config(model), _manifest(1, RECOMMENDED))
        assert (in_force.source, in_force.threshold_for("scratch")) == (
            ThresholdSource.CONFIG,
            0.7,
        )
        assert (in_force.config_version, in_force.tied_to, in_force.model) == (
            3,
            model,
            "inspect:1",
        )


def test_a_config_for_another_model_yields_to_the_models_recommendation() -> None:
    in_force = thresholds_in_force(_config("inspect:1"), _manifest(2, RECOMMENDED))
    assert (in_force.source, in_force.default_threshold, in_force.threshold_for("scratch")) == (
        ThresholdSource.MODEL,
        0.4,
        0.35,
    )
    assert decide({"clean": 0.62, "scratch": 0.38}, ("scratch",), in_force).decision == "reject"
    # The model recommends none: the config applies, untied.
    untied = thresholds_in_force(_config("inspect:1"), _manifest(2))
    assert (untied.source, untied.threshold_for("scratch")) == (ThresholdSource.UNTIED, 0.7)


def test_without_a_config_the_recommendation_or_the_default_applies() -> None:
    assert thresholds_in_force(None, _manifest(2, RECOMMENDED)).source is ThresholdSource.MODEL
    default = thresholds_in_force(None, _manifest(2))
    assert (default.source, default.default_threshold, default.config_version) == (
        ThresholdSource.DEFAULT,
        0.5,
        0,
    )
    assert thresholds_in_force(None, None).describe() == {
        "source": "default",
        "default_threshold": 0.5,
        "class_thresholds": {},
        "config_version": 0,
        "tied_to": None,
        "model": "",
    }


# ---------------------------------------------------------------- the probation's state


def _loaded(tmp_path: Path, version: int) -> LoadedModel:
    path = build_linear_classifier(tmp_path / f"m{version}.onnx", seed=version)
    return runtime.load(path, _manifest(version))


def test_a_trial_survives_a_restart_and_a_failure_starts_the_rollback(tmp_path: Path) -> None:
    policy = ProbationPolicy(images=4, min_images=2)
    store = LocalStore(tmp_path / "agent.db")
    failed: list[tuple[Trial, Verdict]] = []
    done = threading.Event()

    def on_fail(trial: Trial, verdict: Verdict) -> None:
        failed.append((trial, verdict))
        done.set()

    def on_pass(trial: Trial, verdict: Verdict) -> None:
        raise AssertionError(f"{trial.model} passed: {verdict}")

    v1, v2 = _loaded(tmp_path, 1), _loaded(tmp_path, 2)
    varied = np.array([[0.9, 0.1], [0.4, 0.6], [0.7, 0.3], [0.2, 0.8]])
    first = Probation(policy, store, Counter(), on_fail, on_pass)
    first.observe(v1, varied, [1.0] * 4, 0)  # inspect:1's baseline
    trial = first.trial_for(v2, "d-2", 2, "inspect:1", baseline_trusted=True)
    store.put(KEY, encode_trial(trial))  # the deployments store it with the pointers
    first.start(trial)
    assert first.status()["state"] == "on_probation"
    # An unproven previous model's scores are no baseline.
    assert (
        first.trial_for(v2, "d-2", 2, "inspect:1", baseline_trusted=False).baseline_spread is None
    )

    # The agent restarts: the trial of the model still serving starts again.
    counters: Counter[str] = Counter()
    second = Probation(policy, store, counters, on_fail, on_pass)
    assert second.resume("inspect:2") is None
    assert (second.status()["model"], second.status()["images"]) == ("inspect:2", 0)
    assert second.status()["starts"] == 1
    assert second.status()["baseline_spread"] == pytest.approx(health.spread([0.1, 0.6, 0.3, 0.8]))
    second.observe(v1, varied, [1.0] * 4, 0)  # a batch of the old model: not in the window
    assert second.status()["images"] == 0
    second.observe(v2, np.array([[math.nan, math.nan]]), [1.0], 0)
    assert done.wait(5)
    trial, verdict = failed[0]
    assert (trial.model, trial.deployment_id, trial.previous) == ("inspect:2", "d-2", "inspect:1")
    assert verdict.check == "non_finite_scores"
    assert counters["probation.failed.non_finite_scores"] == 1
    second.observe(v2, np.array([[math.nan, math.nan]]), [1.0], 0)  # judged once
    assert len(failed) == 1

    # A restart that fell back to another model drops the trial.
    third = Probation(policy, store, Counter(), on_fail, on_pass)
    third.resume("inspect:1")
    assert third.status() == {"state": "none", "reason": ""}
    store.close()


def test_a_trial_resumed_more_than_max_restarts_times_fails(tmp_path: Path) -> None:
    """A model that kills the agent never fills a window: its starts are counted."""
    policy = ProbationPolicy(images=4, min_images=2, max_restarts=2)
    store = LocalStore(tmp_path / "agent.db")
    store.put(KEY, encode_trial(Trial("inspect:2", "d-2", 2, "inspect:1")))

    def never(trial: Trial, verdict: Verdict) -> None:
        raise AssertionError("judged on images")

    for start in (1, 2):
        assert Probation(policy, store, Counter(), never, never).resume("inspect:2") is None
        assert decode_trial(store.get(KEY)) == Trial(
            "inspect:2", "d-2", 2, "inspect:1", starts=start
        )
    counters: Counter[str] = Counter()
    failed = Probation(policy, store, counters, never, never).resume("inspect:2")
    assert failed is not None
    trial, verdict = failed
    assert (trial.model, trial.starts, verdict.check, verdict.measured, verdict.limit) == (
        "inspect:2",
        3,
        "restarts",
        3.0,
        2.0,
    )
    assert verdict.reason == (
        "restarts: the agent restarted 3 times while this model was on probation (limit 2)"
    )
    assert counters["probation.failed.restarts"] == 1
    assert health.restarted(ProbationPolicy(), 3) is None  # the default allows three
    store.close()


def test_a_failed_trial_goes_back_only_to_the_model_it_replaced() -> None:
    def kept(version: int, deployment: str) -> restore.KeptModel:
        return restore.KeptModel(
            Path(f"/m/{version}"), "inspect", version, deployment_id=deployment
        )

    # Newest first: inspect:4 (the model the manager moved away from), then inspect:1.
    history = (kept(4, "d-4"), kept(1, "d-1"), kept(2, "d-2"))
    assert restore.rollback_target(history, "inspect:1", {}) == kept(1, "d-1")
    # Not kept, or brought by a deployment rolled back here: nothing to go back to.
    assert restore.rollback_target(history, "inspect:3", {}) is None
    assert restore.rollback_target(history, "inspect:2", {"d-2": "latency"}) is None


def test_a_config_comes_back_with_the_model_it_was_set_for() -> None:
    tied_1 = replace(_config("inspect:1"), version=3)
    tied_2 = replace(_config("inspect:2"), version=5, default_threshold=0.8)
    untied = replace(_config(None), version=2)
    configs = served.decode_configs(served.remember_config({}, untied, "inspect:1"))
    assert served.config_for(configs, tied_2, "inspect:1") == untied  # in force as it served
    configs = served.decode_configs(served.remember_config(configs, tied_1, "inspect:1"))
    configs = served.decode_configs(served.remember_config(configs, tied_2, "inspect:1"))
    assert list(configs) == ["inspect:1", "inspect:2"]
    assert served.config_for(configs, tied_2, "inspect:1") == tied_1
    # The config in force applies to the model as set, or none is remembered: no change.
    assert served.config_for(configs, tied_1, "inspect:1") is None
    assert served.config_for(configs, untied, "inspect:1") is None
    assert served.config_for(configs, tied_2, "inspect:7") is None
    assert served.config_for({"inspect:1": "garbage"}, tied_2, "inspect:1") is None
    proven = served.decode_proven(served.add_proven(["inspect:1", "inspect:2"], "inspect:1"))
    assert proven == ("inspect:2", "inspect:1")
    assert served.decode_proven("not json") == () == served.decode_proven(None)


def test_rolled_back_deployments_are_remembered_newest_last_and_bounded() -> None:
    remembered: dict[str, str] = {}
    for i in range(20):
        remembered = restore.add_rolled_back(remembered, f"d-{i}", f"reason {i}")
    decoded = restore.decode_rolled_back(restore.encode_rolled_back(remembered))
    assert list(decoded) == [f"d-{i}" for i in range(4, 20)]
    assert restore.decode_rolled_back("not json") == {} == restore.decode_rolled_back(None)


def test_an_idle_lines_probation_ends_on_time_without_an_image(tmp_path: Path) -> None:
    """The verdict a staged rollout waits for comes when the window's time is up, even
    when no image arrives to be judged on (issue 32, item 1)."""
    policy = ProbationPolicy(images=4, min_images=2, seconds=0.3)
    store = LocalStore(tmp_path / "agent.db")
    passed: list[tuple[Trial, Verdict]] = []
    done = threading.Event()

    def on_pass(trial: Trial, verdict: Verdict) -> None:
        passed.append((trial, verdict))
        done.set()

    def on_fail(trial: Trial, verdict: Verdict) -> None:
        raise AssertionError(f"{trial.model} failed: {verdict}")

    counters: Counter[str] = Counter()
    probation = Probation(policy, store, counters, on_fail, on_pass)
    v2 = _loaded(tmp_path, 2)
    probation.start(probation.trial_for(v2, "d-2", 2, "inspect:1", baseline_trusted=False))
    assert done.wait(5), "no verdict after the probation's time ran out"
    trial, verdict = passed[0]
    assert (trial.model, verdict.outcome, verdict.images) == ("inspect:2", Outcome.PASSED, 0)
    assert "too few to judge" in verdict.note and counters["probation.passed"] == 1
    probation.observe(v2, np.array([[0.9, 0.1]]), [1.0], 0)  # judged once: nothing more
    assert len(passed) == 1 and probation.status()["state"] != "on_probation"
    store.close()

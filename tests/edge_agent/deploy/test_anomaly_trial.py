"""The pair on trial (issue 28): a deployment that changes only the anomaly model beside a
classifier that serves already is a new trial, judged on the new pair's images only, and
a failed one goes back to the previous pair -- the same classifier file kept beside two
anomaly models. Pure decisions and the probation's state, no processes."""

import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

from fedge.edge_agent.deploy import restore
from fedge.edge_agent.deploy.probation import (
    KEY,
    Probation,
    Trial,
    decode_trial,
    encode_trial,
    pair_ref,
)
from fedge.edge_agent.deploy.probation_verdict import ProbationPolicy, Verdict
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.inference.runtime import LoadedModel
from fedge.edge_agent.store import LocalStore
from fedge.models.tiny_onnx import build_linear_classifier
from fedge.protocols.manifest import ModelManifest, TensorSpec
from fedge.protocols.signing import SigningKey

A1, A2 = "inspect-anomaly:1", "inspect-anomaly:2"


def _classifier_manifest() -> ModelManifest:
    return ModelManifest(
        name="inspect",
        version=1,
        sha256="0" * 64,
        size=1,
        inputs=(TensorSpec("image", "float32", ("batch", 1, 32, 32)),),
        outputs=(TensorSpec("probs", "float32", ("batch", 2)),),
        classes=("clean", "scratch"),
        positive_classes=("scratch",),
    )


def _anomaly_manifest(version: int) -> ModelManifest:
    return ModelManifest(
        name="inspect-anomaly",
        version=version,
        sha256=f"{version}" * 64,
        size=1,
        inputs=(TensorSpec("image", "float32", ("batch", 1, 32, 32)),),
        outputs=(TensorSpec("score", "float32", ("batch",)),),
        classes=("good", "anomalous"),
        positive_classes=("anomalous",),
    )


def _pair(classifier: LoadedModel, anomaly_version: int) -> LoadedModel:
    # The probation reads only the anomaly model's ref: the classifier's session stands in.
    return classifier.with_anomaly(replace(classifier, manifest=_anomaly_manifest(anomaly_version)))


def test_a_change_of_only_the_anomaly_model_is_a_trial_of_the_pair(tmp_path: Path) -> None:
    path = build_linear_classifier(tmp_path / "inspect-1.onnx", seed=1)
    classifier = runtime.load(path, _classifier_manifest())
    old, new = _pair(classifier, 1), _pair(classifier, 2)
    store = LocalStore(tmp_path / "agent.db")
    failed: list[tuple[Trial, Verdict]] = []
    done = threading.Event()

    def on_fail(trial: Trial, verdict: Verdict) -> None:
        failed.append((trial, verdict))
        done.set()

    def on_pass(trial: Trial, verdict: Verdict) -> None:
        raise AssertionError(f"{trial.pair} passed: {verdict}")

    probation = Probation(
        ProbationPolicy(images=4, min_images=2), store, Counter(), on_fail, on_pass
    )
    varied = np.array([[0.9, 0.1], [0.4, 0.6], [0.7, 0.3], [0.2, 0.8]])
    probation.observe(old, varied, [1.0] * 4, 0)  # the serving pair's baseline
    trial = probation.trial_for(
        new, "d-2", 2, "inspect:1", baseline_trusted=True, previous_anomaly=A1
    )
    assert (trial.model, trial.anomaly, trial.previous, trial.previous_anomaly) == (
        "inspect:1",
        A2,
        "inspect:1",
        A1,
    )
    assert (trial.pair, trial.previous_pair) == (f"inspect:1+{A2}", f"inspect:1+{A1}")
    assert trial.baseline_spread is not None  # the same classifier's scores
    store.put(KEY, encode_trial(trial))
    probation.start(trial)
    assert probation.status()["anomaly"] == A2

    # The old pair's images (in flight at the swap) are not the new pair's window.
    probation.observe(old, varied, [1.0] * 4, 0)
    assert probation.status()["images"] == 0
    probation.observe(new, np.array([[np.nan, np.nan]]), [1.0], 0)
    assert done.wait(5)
    assert failed[0][0].pair == f"inspect:1+{A2}"
    assert failed[0][1].check == "non_finite_scores"

    # A restart serving the old pair (it fell back) drops the trial; the new pair resumes.
    assert (
        Probation(ProbationPolicy(), store, Counter(), on_fail, on_pass).resume("inspect:1", A1)
        is None
    )
    assert store.get(KEY) == ""
    store.put(KEY, encode_trial(trial))
    resumed = Probation(ProbationPolicy(), store, Counter(), on_fail, on_pass)
    assert resumed.resume("inspect:1", A2) is None
    assert resumed.status()["state"] == "on_probation"
    store.close()


def test_a_trial_names_its_pair_and_one_stored_before_pairs_matches_any() -> None:
    trial = Trial("inspect:1", "d-2", 2, "inspect:1", anomaly=A2, previous_anomaly=A1)
    assert decode_trial(encode_trial(trial)) == trial
    assert trial.matches("inspect:1", A2)
    assert not trial.matches("inspect:1", A1) and not trial.matches("inspect:1", "")
    # Stored by an agent before pairs were judged: no anomaly fields, any pair matches.
    legacy = decode_trial(
        '{"model":"inspect:2","deployment_id":"d-2","deployment_version":2,"previous":"inspect:1"}'
    )
    assert legacy is not None and legacy.anomaly is None and legacy.previous_anomaly is None
    assert legacy.matches("inspect:2", A1) and legacy.pair == "inspect:2"
    assert pair_ref("inspect:1", "") == "inspect:1"


def test_one_classifier_is_kept_beside_two_anomaly_models_and_goes_back_to_its_pair() -> None:
    key = SigningKey.generate()

    def kept(anomaly: int, deployment: str) -> restore.KeptModel:
        return restore.KeptModel(
            Path("/m/inspect/1/model.onnx"),
            "inspect",
            1,
            deployment_id=deployment,
            anomaly_path=f"/m/inspect-anomaly/{anomaly}/model.onnx" if anomaly else "",
            anomaly_envelope=key.sign(_anomaly_manifest(anomaly)).decode() if anomaly else "",
        )

    alone, with_1, with_2 = kept(0, "d-0"), kept(1, "d-1"), kept(2, "d-2")
    assert (alone.anomaly_ref, with_1.anomaly_ref, with_2.anomaly_ref) == ("", A1, A2)
    # Remembering the new pair keeps the old pair of the same classifier file.
    history = restore.remember(restore.remember((alone,), with_1), with_2)
    assert history == (with_2, with_1, alone)
    assert restore.candidates(with_2, history) == (with_2, with_1, alone)
    rest = restore.without(history, with_2)
    assert rest == (with_1, alone)
    # A failed pair goes back to the pair it replaced, not to the classifier's newest.
    assert restore.rollback_target(rest, "inspect:1", {}, A1) == with_1
    assert restore.rollback_target(rest, "inspect:1", {}, "") == alone
    assert restore.rollback_target(rest, "inspect:1", {"d-1": "bad"}, A1) is None
    # A trial stored before pairs: the newest kept model of the classifier, as before.
    assert restore.rollback_target(rest, "inspect:1", {}, None) == with_1


def test_a_pair_on_trial_counts_images_its_anomaly_model_could_not_score(
    tmp_path: Path,
) -> None:
    path = build_linear_classifier(tmp_path / "inspect-1.onnx", seed=1)
    classifier = runtime.load(path, _classifier_manifest())
    new = _pair(classifier, 2)
    store = LocalStore(tmp_path / "agent.db")
    failed: list[Verdict] = []
    done = threading.Event()

    def on_fail(trial: Trial, verdict: Verdict) -> None:
        failed.append(verdict)
        done.set()

    def on_pass(trial: Trial, verdict: Verdict) -> None:
        raise AssertionError(f"{trial.pair} passed: {verdict}")

    policy = ProbationPolicy(images=10, min_images=2, max_error_rate=0.1)
    probation = Probation(policy, store, Counter(), on_fail, on_pass)
    # A classifier's trial: the anomaly model's misses are not its failures.
    alone = Trial("inspect:1", "d-1", 1, "inspect:0", anomaly="")
    probation.start(alone)
    rows = np.array([[0.9, 0.1], [0.4, 0.6], [0.7, 0.3]])
    probation.observe(classifier, rows, [1.0] * 3, 0, anomaly_unscored=[True] * 3)
    assert probation.status()["images"] == 3 and not done.is_set()

    trial = probation.trial_for(
        new, "d-2", 2, "inspect:1", baseline_trusted=False, previous_anomaly=A1
    )
    probation.start(trial)
    probation.observe(new, rows, [1.0] * 3, 0, anomaly_unscored=[False] * 3)
    assert probation.status()["images"] == 3
    # Two of three images without an anomaly score: over 1 allowed error in 10.
    probation.observe(new, rows, [1.0] * 3, 0, anomaly_unscored=[True, False, True])
    assert done.wait(5)
    assert failed[0].check == "inference_errors"
    assert failed[0].reason.startswith("inference_errors: 2 of 6 image(s) failed to score")
    store.close()

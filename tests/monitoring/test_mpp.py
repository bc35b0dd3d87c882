"""The MPP predictor and the confidence baselines on synthetic predictions (pure, fast)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from fedge.monitoring.features import IMAGE_STATS
from fedge.monitoring.mpp import (
    DESIGN,
    FEATURES,
    MppPredictor,
    _design,
    calibration_estimate,
    feature_row,
)


def synthetic(
    seed: int, n: int, *, top_low: float = 0.5, sharpness: float = 12.0
) -> tuple[list[list[float]], list[bool], list[dict[str, float]]]:
    """Predictions whose correctness depends on the margin, not on the top score itself.

    P(correct) = sigmoid(sharpness * (margin - 0.5)): overconfident at small margins, so
    the mean top score is *not* the accuracy, while a fitted MPP can learn the mapping.
    Image statistics are noise the fit must learn to ignore.
    """
    rng = np.random.default_rng(seed)
    top = rng.uniform(top_low, 1.0, n)
    margin = 2.0 * top - 1.0
    correct = rng.random(n) < 1.0 / (1.0 + np.exp(-sharpness * (margin - 0.5)))
    scores = [{"clean": float(1.0 - t), "scratch": float(t)} for t in top]
    rows = []
    for one in scores:
        stats = {name: float(v) for name, v in zip(IMAGE_STATS, rng.random(5), strict=True)}
        rows.append(feature_row(one, stats))
    return rows, correct.tolist(), scores


def test_feature_row_is_score_features_then_image_stats() -> None:
    stats = {"mean": 0.5, "std": 0.1, "p05": 0.3, "p95": 0.7, "edges": 0.02, "extra": 9.0}
    row = feature_row({"clean": 0.2, "scratch": 0.8}, stats)
    assert len(row) == len(FEATURES) == 8
    assert row[0] == pytest.approx(0.8)  # top
    assert row[1] == pytest.approx(0.6)  # margin
    assert 0.0 < row[2] < 1.0  # normalised entropy
    assert row[3:] == [0.5, 0.1, 0.3, 0.7, 0.02]


def test_estimate_is_close_to_true_accuracy_where_confidence_is_not() -> None:
    rows, correct, _ = synthetic(0, 3000)
    mpp = MppPredictor.fit(rows, correct)
    # Calibrated in the large on its own fit data (the intercept's score equation).
    assert mpp.estimate(rows) == pytest.approx(np.mean(correct), abs=1e-6)

    test_rows, test_correct, test_scores = synthetic(1, 3000)
    assert abs(mpp.estimate(test_rows) - np.mean(test_correct)) < 0.02
    # The confidence baseline is off by far more: these scores are overconfident.
    assert abs(calibration_estimate(test_scores) - np.mean(test_correct)) > 0.1

    # A shift of the score distribution (more confident inputs) with the same P(correct |
    # features) is what MPP is built for: it still tracks the accuracy.
    shifted_rows, shifted_correct, _ = synthetic(2, 3000, top_low=0.6)
    assert np.mean(shifted_correct) - np.mean(test_correct) > 0.05
    assert abs(mpp.estimate(shifted_rows) - np.mean(shifted_correct)) < 0.02


def test_average_thresholded_confidence_matches_held_out_accuracy() -> None:
    rows, correct, _ = synthetic(3, 2000)
    mpp = MppPredictor.fit(rows, correct)
    assert mpp.estimate_atc(rows) == pytest.approx(np.mean(correct), abs=1e-3)


def test_newton_fit_equals_scikit_learns_logistic_regression() -> None:
    rows, correct, _ = synthetic(4, 1000)
    mpp = MppPredictor.fit(rows, correct)
    z = (_design(np.asarray(rows)) - mpp.mean) / mpp.scale
    reference = LogisticRegression(C=1.0, tol=1e-10, max_iter=10_000).fit(z, correct)
    assert np.allclose(mpp.coef, reference.coef_[0], atol=1e-4)
    assert mpp.intercept == pytest.approx(reference.intercept_[0], abs=1e-4)
    assert len(mpp.coef) == len(DESIGN)


def test_json_round_trip_gives_identical_estimates() -> None:
    rows, correct, _ = synthetic(5, 500)
    mpp = MppPredictor.fit(rows, correct)
    text = mpp.to_json()
    assert "pickle" not in text and json.loads(text)["format"] == "fedge.mpp.logistic"
    again = MppPredictor.from_json(text)
    test_rows, _, _ = synthetic(6, 300)
    assert again.estimate(test_rows) == mpp.estimate(test_rows)
    assert again.estimate_atc(test_rows) == mpp.estimate_atc(test_rows)
    assert again.to_json() == text


def test_all_correct_gives_a_smoothed_constant() -> None:
    rows, _, _ = synthetic(7, 40)
    mpp = MppPredictor.fit(rows, [True] * 40)
    assert mpp.estimate(rows) == pytest.approx(40.5 / 41)
    assert not np.any(mpp.coef)


def test_calibration_estimate_is_the_mean_top_score() -> None:
    scores = [{"a": 0.9, "b": 0.1}, {"a": 0.3, "b": 0.7}]
    assert calibration_estimate(scores) == pytest.approx(0.8)


def test_bad_input_is_a_clear_error() -> None:
    rows, correct, _ = synthetic(8, 50)
    mpp = MppPredictor.fit(rows, correct)
    with pytest.raises(ValueError, match="at least one feature row"):
        mpp.estimate([])
    with pytest.raises(ValueError, match="8 values"):
        mpp.estimate([[0.9, 0.8, 0.1]])
    with pytest.raises(ValueError, match="8 numbers each"):
        mpp.estimate([rows[0], rows[1][:3]])
    with pytest.raises(ValueError, match="8 numbers each"):
        mpp.estimate([["x"] * 8])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="NaN"):
        mpp.estimate([[float("nan")] * 8])
    with pytest.raises(ValueError, match="50 rows but 49"):
        MppPredictor.fit(rows, correct[:-1])
    with pytest.raises(ValueError, match="at least 10 rows"):
        MppPredictor.fit(rows[:5], correct[:5])
    with pytest.raises(ValueError, match="missing \\['edges'\\]"):
        feature_row({"a": 1.0}, {"mean": 0, "std": 0, "p05": 0, "p95": 0})
    with pytest.raises(ValueError, match="NaN"):
        feature_row({"a": float("nan"), "b": 0.5}, dict.fromkeys(IMAGE_STATS, 0.0))
    with pytest.raises(ValueError, match="at least one score"):
        feature_row({}, dict.fromkeys(IMAGE_STATS, 0.0))
    with pytest.raises(ValueError, match="at least one score vector"):
        calibration_estimate([])


def test_from_json_rejects_what_it_did_not_write() -> None:
    rows, correct, _ = synthetic(9, 50)
    good = json.loads(MppPredictor.fit(rows, correct).to_json())
    with pytest.raises(ValueError, match="not JSON"):
        MppPredictor.from_json("{oops")
    with pytest.raises(ValueError, match="not an MPP model"):
        MppPredictor.from_json("[1, 2]")
    with pytest.raises(ValueError, match="version 2"):
        MppPredictor.from_json(json.dumps(good | {"version": 2}))
    with pytest.raises(ValueError, match="refit"):
        MppPredictor.from_json(json.dumps(good | {"features": ["top"]}))
    with pytest.raises(ValueError, match="lacks or mistypes"):
        MppPredictor.from_json(json.dumps({k: v for k, v in good.items() if k != "coef"}))
    with pytest.raises(ValueError, match="coefficients"):
        MppPredictor.from_json(json.dumps(good | {"coef": [1.0]}))
    with pytest.raises(ValueError, match="finite"):
        MppPredictor.from_json(json.dumps(good).replace(str(good["intercept"]), "NaN"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_fit": True}, "n_fit"),
        ({"n_fit": 0}, "n_fit"),
        ({"n_fit": -5}, "n_fit"),
        ({"n_fit": 10**12}, "n_fit"),
        ({"n_fit": 50.5}, "n_fit"),
        ({"fit_accuracy": 1.5}, "fit_accuracy"),
        ({"fit_accuracy": -0.1}, "fit_accuracy"),
        ({"fit_accuracy": True}, "fit_accuracy"),
        ({"intercept": False}, "intercept"),
        ({"atc_threshold": "0.5"}, "atc_threshold"),
        ({"coef": "abcdefghijk"}, "coef"),
        ({"mean": {"a": 1}}, "mean"),
        ({"scale": [None] * 10}, "scale"),
        ({"version": True}, "version"),
    ],
)
def test_from_json_rejects_corrupt_fields(change: dict[str, object], message: str) -> None:
    rows, correct, _ = synthetic(9, 50)
    good = json.loads(MppPredictor.fit(rows, correct).to_json())
    with pytest.raises(ValueError, match=message):
        MppPredictor.from_json(json.dumps(good | change))


def test_from_json_turns_any_failure_into_value_error() -> None:
    rows, correct, _ = synthetic(9, 50)
    good = json.loads(MppPredictor.fit(rows, correct).to_json())
    infinite = json.dumps(good).replace(str(good["coef"][0]), "Infinity", 1)
    with pytest.raises(ValueError, match="finite"):
        MppPredictor.from_json(infinite)
    huge = json.dumps(good).replace(str(good["coef"][0]), "1e999", 1)  # inf once parsed
    with pytest.raises(ValueError, match="finite"):
        MppPredictor.from_json(huge)
    for text in (None, b"\xff", 3, "[" * 100_000):
        with pytest.raises(ValueError):
            MppPredictor.from_json(text)  # type: ignore[arg-type]

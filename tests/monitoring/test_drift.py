"""PSI, the KS p-value and ``detect`` on seeded synthetic windows (pure, milliseconds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats  # type: ignore[import-untyped]  # no stubs; only the reference

from fedge.monitoring.drift import DriftPolicy, FeatureDrift, detect, ks_p_value, psi


def normal(seed: int, n: int, loc: float = 0.0, scale: float = 1.0) -> list[float]:
    return [float(v) for v in np.random.default_rng(seed).normal(loc, scale, n)]


def test_psi_of_identical_samples_is_zero() -> None:
    sample = normal(0, 500)
    assert psi(sample, sample) == pytest.approx(0.0, abs=1e-12)


def test_psi_of_same_distribution_is_small_and_of_a_shift_is_large() -> None:
    reference = normal(0, 2000)
    assert psi(reference, normal(1, 2000)) < 0.02
    assert psi(reference, normal(2, 2000, loc=1.0)) > 0.5
    assert psi(reference, normal(3, 2000, scale=3.0)) > 0.5


def test_psi_matches_a_hand_computed_value() -> None:
    # Two bins split at the reference median 1.5: reference 50/50, current 75/25.
    reference, current = [1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 2.0]
    expected = (0.75 - 0.5) * math.log(0.75 / 0.5) + (0.25 - 0.5) * math.log(0.25 / 0.5)
    assert psi(reference, current, bins=2) == pytest.approx(expected)


def test_psi_of_a_constant_feature_sees_shifts_both_ways() -> None:
    constant = [3.0] * 200
    assert psi(constant, [3.0] * 150) == pytest.approx(0.0, abs=1e-12)
    assert psi(constant, [4.0] * 150) > 5.0
    assert psi(constant, [2.0] * 150) > 5.0


def test_psi_with_tied_quantiles_merges_bins_and_stays_finite() -> None:
    # 80 % zeros: most reference quantiles are 0; the bins merge instead of emptying.
    reference = [0.0] * 160 + np.linspace(1.0, 2.0, 40).tolist()
    same = [0.0] * 80 + np.linspace(1.0, 2.0, 20).tolist()
    assert psi(reference, same) == pytest.approx(0.0, abs=1e-3)
    assert math.isfinite(psi(reference, [0.0] * 100))
    assert psi(reference, [0.0] * 20 + [1.5] * 80) > 1.0


def test_ks_p_value_agrees_with_scipy() -> None:
    for seed, shift in [(0, 0.0), (1, 0.3), (2, 0.6)]:
        reference, current = normal(seed, 1000), normal(seed + 10, 100, loc=shift)
        ours = ks_p_value(reference, current)
        theirs = stats.ks_2samp(reference, current).pvalue
        assert ours == pytest.approx(theirs, rel=0.15, abs=1e-4), (seed, ours, theirs)


def test_ks_p_value_handles_ties() -> None:
    assert ks_p_value([1.0] * 100, [1.0] * 100) == 1.0
    assert ks_p_value([0.0] * 100, [1.0] * 100) < 1e-10


def test_detect_fires_on_a_shift_and_not_in_distribution() -> None:
    reference = {"mean": normal(0, 2000, 0.5, 0.1), "std": normal(1, 2000, 0.1, 0.02)}
    false_alerts = 0
    for seed in range(20):
        same = {
            "mean": normal(100 + seed, 100, 0.5, 0.1),
            "std": normal(200 + seed, 100, 0.1, 0.02),
        }
        false_alerts += sum(v.drifted for v in detect(reference, same))
    assert false_alerts == 0

    shifted = {"mean": normal(9, 100, 0.6, 0.1), "std": normal(10, 100, 0.1, 0.02)}
    verdicts = {v.feature: v for v in detect(reference, shifted)}
    assert verdicts["mean"].drifted
    assert verdicts["mean"].psi >= 0.25 and verdicts["mean"].p_value < 1e-3
    assert not verdicts["std"].drifted


def test_detect_needs_min_window_values_and_says_why() -> None:
    reference = {"mean": normal(0, 500)}
    (verdict,) = detect(reference, {"mean": normal(1, 50, loc=5.0)})
    assert not verdict.drifted
    assert "50 current" in verdict.reason and "need 100" in verdict.reason
    assert verdict.psi > 1.0  # still measured, for the record

    (empty,) = detect(reference, {"mean": []})
    assert empty == FeatureDrift("mean", 0.0, 1.0, False, empty.reason)
    assert "0 current" in empty.reason


def test_detect_reports_shared_features_in_reference_order() -> None:
    reference = {"b": normal(0, 200), "a": normal(1, 200), "only_ref": normal(2, 200)}
    current = {"a": normal(3, 200), "b": normal(4, 200), "only_cur": normal(5, 200)}
    assert [v.feature for v in detect(reference, current)] == ["b", "a"]


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="share no feature"):
        detect({"mean": [1.0]}, {"std": [1.0]})
    with pytest.raises(ValueError, match=r"'mean'.*NaN"):
        detect({"mean": normal(0, 200)}, {"mean": [*normal(1, 199), float("nan")]})
    with pytest.raises(ValueError, match="empty"):
        psi([], [1.0])
    with pytest.raises(ValueError, match="empty"):
        psi([1.0], [])
    with pytest.raises(ValueError, match="NaN or infinite"):
        psi([1.0, float("inf")], [1.0])
    with pytest.raises(ValueError, match="bins"):
        psi([1.0, 2.0], [1.0], bins=1)
    with pytest.raises(ValueError, match="p_value"):
        DriftPolicy(p_value=0.0)
    with pytest.raises(ValueError, match="min_window"):
        DriftPolicy(min_window=0)
    with pytest.raises(ValueError, match="psi_alert"):
        DriftPolicy(psi_alert=float("nan"))

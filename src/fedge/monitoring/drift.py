"""Input and score drift of one edge against its model's reference window.

Two measures per feature (an image statistic or a score feature, see
:mod:`fedge.monitoring.features`):

- the **population stability index** (PSI), the credit-scoring industry's drift measure
  (Siddiqi, "Credit Risk Scorecards", 2006; Yurdakul, "Statistical properties of the
  population stability index", 2018): ``sum((c - r) * ln(c / r))`` over bins cut at the
  reference's quantiles, so every reference bin holds about the same share;
- the **two-sample Kolmogorov-Smirnov test**'s p-value (the largest gap between the two
  empirical CDFs), which, unlike the PSI, has a known null distribution.

:func:`detect` flags a feature when **both** say so: PSI >= ``psi_alert`` (the shift is
large enough to matter; 0.25 is the customary "significant shift" level) **and**
p < ``p_value`` (the shift is not sampling noise). Either alone is a poor alarm on
windows of about 100 values: under no drift, PSI on 10 bins with 100 values per side is
about chi2(9) / 50, above 0.25 roughly one window in five (Yurdakul 2018); and the KS
test flags tiny but real shifts of no consequence once windows grow. Together they give
"a real shift of a size that matters".

NumPy only (the manager runs without SciPy): the KS p-value uses the asymptotic
Kolmogorov distribution with Stephens' small-sample correction (Stephens, "Use of the
Kolmogorov-Smirnov, Cramer-von Mises and related statistics without extensive tables",
JRSS B 1970), as in Numerical Recipes' ``kstwo``; it agrees with SciPy's exact p-value
to within a few per cent relative at the sizes used here (see the tests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

EPSILON = 1e-4
"""Share given to a bin with no values, so the PSI stays finite (a common choice)."""


@dataclass(frozen=True)
class DriftPolicy:
    """When a feature counts as drifted (see the module docstring for the rule)."""

    psi_alert: float = 0.25
    p_value: float = 1e-3
    min_window: int = 100
    bins: int = 10

    def __post_init__(self) -> None:
        if not (math.isfinite(self.psi_alert) and self.psi_alert > 0):
            raise ValueError(f"psi_alert must be a positive number, got {self.psi_alert}")
        if not 0.0 < self.p_value < 1.0:
            raise ValueError(f"p_value must be in (0, 1), got {self.p_value}")
        if self.min_window < 1:
            raise ValueError(f"min_window must be >= 1, got {self.min_window}")
        if self.bins < 2:
            raise ValueError(f"bins must be >= 2, got {self.bins}")


@dataclass(frozen=True)
class FeatureDrift:
    """One feature's verdict. ``reason`` says why it was not judged (too few values)."""

    feature: str
    psi: float
    p_value: float
    drifted: bool
    reason: str = ""


def psi(reference: Sequence[float], current: Sequence[float], bins: int = 10) -> float:
    """Population stability index of ``current`` against ``reference``.

    Bins are cut at the reference's ``1/bins, 2/bins, ...`` quantiles; the outer bins are
    open, so values beyond the reference's range land in them. Tied quantiles (a feature
    with a few distinct values) merge their bins rather than leave empty ones; when the
    lowest cut is the reference's minimum (a constant feature, or an atom at the bottom)
    a bin for "below the reference" is added, so a shift down is seen as well as a shift
    up. An empty bin counts as ``EPSILON`` of its side.
    """
    ref = _finite("reference", reference)
    cur = _finite("current", current)
    if bins < 2:
        raise ValueError(f"bins must be >= 2, got {bins}")
    edges = np.unique(np.quantile(ref, np.linspace(0.0, 1.0, bins + 1)[1:-1]))
    below_min = bool(edges[0] <= ref.min())
    n_bins = edges.size + 1 + int(below_min)
    ref_share = _shares(_bin_index(ref, edges, below_min), n_bins)
    cur_share = _shares(_bin_index(cur, edges, below_min), n_bins)
    return float(np.sum((cur_share - ref_share) * np.log(cur_share / ref_share)))


def ks_p_value(reference: Sequence[float], current: Sequence[float]) -> float:
    """Two-sided p-value of the two-sample Kolmogorov-Smirnov test (asymptotic, corrected)."""
    ref = np.sort(_finite("reference", reference))
    cur = np.sort(_finite("current", current))
    grid = np.concatenate([ref, cur])
    # ECDFs evaluated at every observed value; side="right" handles ties correctly.
    gap = np.abs(
        np.searchsorted(ref, grid, side="right") / ref.size
        - np.searchsorted(cur, grid, side="right") / cur.size
    )
    statistic = float(gap.max())
    effective_n = math.sqrt(ref.size * cur.size / (ref.size + cur.size))
    return _kolmogorov_q((effective_n + 0.12 + 0.11 / effective_n) * statistic)


def detect(
    reference: Mapping[str, Sequence[float]],
    current: Mapping[str, Sequence[float]],
    policy: DriftPolicy = DriftPolicy(),
) -> list[FeatureDrift]:
    """One verdict per feature present in both windows, in the reference's order.

    A feature with fewer than ``policy.min_window`` values on either side is not drifted
    (``reason`` says how many it had); its PSI and p-value are still given when both
    sides have values (0 and 1 when one is empty). Non-finite values raise
    ``ValueError`` naming the feature; so do windows that share no feature.
    """
    shared = [name for name in reference if name in current]
    if not shared:
        raise ValueError(
            "reference and current windows share no feature: reference has "
            f"{sorted(reference)}, current has {sorted(current)}"
        )
    verdicts: list[FeatureDrift] = []
    for name in shared:
        ref, cur = reference[name], current[name]
        try:
            if len(ref) == 0 or len(cur) == 0:
                _finite(name, ref, allow_empty=True)
                _finite(name, cur, allow_empty=True)
                value, p_value = 0.0, 1.0
            else:
                value = psi(ref, cur, policy.bins)
                p_value = ks_p_value(ref, cur)
        except ValueError as exc:
            raise ValueError(f"feature {name!r}: {exc}") from exc
        if len(ref) < policy.min_window or len(cur) < policy.min_window:
            reason = (
                f"too few values to judge: {len(ref)} reference, {len(cur)} current, "
                f"need {policy.min_window} in both"
            )
            verdicts.append(FeatureDrift(name, value, p_value, False, reason))
            continue
        drifted = value >= policy.psi_alert and p_value < policy.p_value
        verdicts.append(FeatureDrift(name, value, p_value, drifted))
    return verdicts


def _finite(
    what: str, values: Sequence[float], *, allow_empty: bool = False
) -> npt.NDArray[np.float64]:
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0 and not allow_empty:
        raise ValueError(f"{what} window is empty: PSI and the KS test need values")
    bad = int(np.count_nonzero(~np.isfinite(array)))
    if bad:
        raise ValueError(f"{what} window has {bad} NaN or infinite value(s); drop them first")
    return array


def _bin_index(
    values: npt.NDArray[np.float64], edges: npt.NDArray[np.float64], below_min: bool
) -> npt.NDArray[np.intp]:
    # side="left": bins are (e[i-1], e[i]], so a tied quantile value stays with its atom.
    index = np.searchsorted(edges, values, side="left")
    if below_min:
        # The first bin becomes [min, e0] and values under the reference's min get bin 0.
        index = np.where(values < edges[0], 0, index + 1)
    return index


def _shares(index: npt.NDArray[np.intp], n_bins: int) -> npt.NDArray[np.float64]:
    counts = np.bincount(index, minlength=n_bins).astype(np.float64)
    shares: npt.NDArray[np.float64] = np.maximum(counts / counts.sum(), EPSILON)
    return shares


def _kolmogorov_q(lam: float) -> float:
    """``Q_KS(lam) = 2 sum_{j>=1} (-1)^(j-1) exp(-2 j^2 lam^2)``, the Kolmogorov tail."""
    if lam < 0.2:
        return 1.0  # the series converges slowly here and the tail is 1 to 1e-9
    total, sign = 0.0, 1.0
    for j in range(1, 101):
        term = sign * math.exp(-2.0 * j * j * lam * lam)
        total += term
        if abs(term) < 1e-12 * max(total, 1e-300):
            break
        sign = -sign
    return float(min(max(2.0 * total, 0.0), 1.0))

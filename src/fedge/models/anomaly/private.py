"""A station's statistics released with differential privacy (the Gaussian mechanism).

Each part's feature vector at each location is clipped to L2 norm ``clip``; then one
part changes the release ``(count, total / clip, upper(outer) / clip^2)`` by at most
``sensitivity(L) = sqrt(1 + 2 L)`` in L2 norm (1 for the count, ``sqrt(L)`` for the sums
over L locations of vectors of norm <= 1, and ``sqrt(L)`` for the outer products, whose
upper triangles have Frobenius norm <= ``||x||^2 <= 1``). Gaussian noise of standard
deviation ``noise_multiplier * sensitivity`` on every coordinate of that vector is the
Gaussian mechanism (Dwork & Roth, *The Algorithmic Foundations of DP*, 2014, A.1).

Accounting: one release is one Gaussian mechanism on the station's whole data, i.e. an
entry ``DpRelease(noise_multiplier, sample_rate=1.0, steps=1)`` of the station's ledger
(:mod:`fedge.party.budget`, composed with RDP by :mod:`fedge.privacy.accounting`;
Mironov, CSF 2017). The outer products' noise is drawn on the upper triangle and
mirrored, so the released matrices stay symmetric without spending more.

The noisy statistics are still sums, so SecAgg+ adds them as it adds clean ones; the
fleet's sum then carries every station's noise (variances add), and :func:`~fedge.models.
anomaly.statistics.fit` clips the negative eigenvalues noise can cause.
"""

from __future__ import annotations

import math

import numpy as np

from fedge.models.anomaly import StatisticsError
from fedge.models.anomaly.statistics import Float64Array, SufficientStatistics


def clip_features(features: Float64Array, clip: float) -> Float64Array:
    """``features`` ``(n, L, d)`` with every location's vector scaled to norm <= ``clip``."""
    if not (math.isfinite(clip) and clip > 0):
        raise StatisticsError(f"the clipping norm must be > 0, got {clip}")
    norms = np.linalg.norm(features, axis=2, keepdims=True)
    scale = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    clipped: Float64Array = features * scale
    return clipped


def sensitivity(locations: int) -> float:
    """L2 sensitivity of one part on the normalised release (module docstring)."""
    return math.sqrt(1.0 + 2.0 * locations)


def noisy_statistics(
    stats: SufficientStatistics,
    *,
    clip: float,
    noise_multiplier: float,
    rng: np.random.Generator,
) -> SufficientStatistics:
    """``stats`` of *clipped* features with the Gaussian mechanism's noise added.

    The caller computed ``stats`` from :func:`clip_features` output with the same ``clip``
    (it cannot be checked from the sums alone) and records the release in its ledger.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise StatisticsError(f"the noise multiplier must be > 0, got {noise_multiplier}")
    if not (math.isfinite(clip) and clip > 0):
        raise StatisticsError(f"the clipping norm must be > 0, got {clip}")
    locations = stats.total.shape[0]
    sigma = noise_multiplier * sensitivity(locations)
    count = stats.count + sigma * rng.normal()
    total = stats.total + clip * sigma * rng.normal(size=stats.total.shape)
    upper = np.triu(rng.normal(size=stats.outer.shape))
    symmetric = upper + np.swapaxes(np.triu(upper, k=1), 1, 2)
    outer = stats.outer + clip**2 * sigma * symmetric
    # Rounding the noisy count is post-processing; a fit needs at least one part.
    return SufficientStatistics(
        count=max(1, round(count)), total=total, outer=outer, grid=stats.grid
    )

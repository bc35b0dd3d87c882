"""SecAgg+ for an anomaly job's moments: ranges chosen from the clip, and the bound they keep.

The stations' statistics are sums, so Flower's SecAgg+ (Bell et al., CCS 2020) adds them
as it adds model updates: each station sends its per-part moments ``total / n`` and
``outer / n`` weighted by its count ``n``, and the server learns only their weighted mean
(:mod:`fedge.aggregator.privacy.secagg`). SecAgg+ quantises, so the mean is exact only to
a bound, which this module chooses and states (pure functions).

**Ranges from the clip.** With every location's feature vector clipped to L2 norm ``C``
(``[anomaly] clip``), every first moment lies in ``[-C, C]`` and every second moment in
``[-C^2, C^2]`` (``|x_a x_b| <= ||x||^2``): the clipping range is ``max(C, C^2)``, so
nothing a station sends is clipped while its count is at most ``max_weight``. The
quantisation range is the largest power of two whose sums over the job's stations cannot
wrap the 2**32 modulus (``parties * T < 2**32``), at most 2**30 (Flower rounds into
int32): 2**29 for 3-4 stations, 2**22 (Flower's default) at 257-512, less past that.

**The bound.** :func:`~fedge.aggregator.privacy.secagg.quantization_error_bound` gives
``eps``, the largest difference of any moment from the plain weighted mean, for the
round's counts. The fit (:func:`fedge.models.anomaly.statistics.fit`) then moves by at
most (:func:`fit_bounds`):

- mean: ``eps`` per entry (the mean is the first moment);
- covariance, per location in Frobenius norm (so every entry too):
  ``d * delta * n / (n - 1)`` with ``delta = eps (1 + 2C) + eps^2``, the bound on an entry of
  ``outer / n - mean mean^T``; the shrinkage target (its trace) moves by no more, and
  clipping negative eigenvalues is a projection, which never increases a Frobenius
  distance. For ``n = 1`` the fit's ``max(n - 1, 1)`` denominators are used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fedge.aggregator.privacy.secagg import DEFAULT_MODULUS_RANGE, quantization_error_bound
from fedge.models.anomaly.statistics import DEFAULT_PRIOR_PARTS
from fedge.privacy.settings import PrivacyError, PrivacySpec

MAX_QUANTIZATION_RANGE = 2**30
"""Flower's stochastic rounding casts to int32."""


def moment_range(clip: float) -> float:
    """The largest absolute moment of features clipped to L2 norm ``clip``."""
    if not (math.isfinite(clip) and clip > 0):
        raise PrivacyError(f"SecAgg+ of anomaly statistics needs anomaly.clip > 0, got {clip}")
    return max(clip, clip * clip)


def quantization_range(parties: int, modulus_range: int = DEFAULT_MODULUS_RANGE) -> int:
    """The largest power of two ``T`` with ``parties * T < modulus_range`` (at most 2**30)."""
    if parties < 1:
        raise PrivacyError(f"SecAgg+ needs parties, got {parties}")
    exponent = int(math.log2(modulus_range)) - 1 - math.ceil(math.log2(parties))
    if exponent < 1:
        raise PrivacyError(
            f"{parties} stations' quantised moments would wrap SecAgg+'s modulus "
            f"{modulus_range}: run the job on fewer stations"
        )
    return int(min(2**exponent, MAX_QUANTIZATION_RANGE))


def secagg_privacy(privacy: PrivacySpec, *, clip: float, parties: int) -> PrivacySpec:
    """The job's ``[privacy]`` with SecAgg+'s ranges chosen from ``clip`` (module docstring)."""
    if not privacy.secagg:
        raise PrivacyError("privacy.secagg is off: this anomaly job does not run SecAgg+")
    return dataclasses.replace(
        privacy,
        secagg_clipping_range=moment_range(clip),
        secagg_quantization_range=quantization_range(parties),
    )


@dataclass(frozen=True)
class FitBounds:
    """How far SecAgg+'s quantisation may move the fit from the plain round's."""

    moments: float
    """Per entry of the pooled moments."""
    mean: float
    """Per entry of each location's mean."""
    covariance: float
    """Per location, Frobenius norm of the covariance's difference (so per entry too)."""


def fit_bounds(
    counts: Sequence[int],
    *,
    clip: float,
    dims: int,
    privacy: PrivacySpec,
    max_weight: float,
    prior_parts: float = DEFAULT_PRIOR_PARTS,
) -> FitBounds:
    """The bounds of a SecAgg+ round whose stations had ``counts`` good parts.

    ``privacy`` is :func:`secagg_privacy`'s (its ranges). Raises ValueError when a count
    is above ``max_weight`` (its moments would be clipped: no bound holds)."""
    peak = moment_range(clip)
    eps = quantization_error_bound(
        [float(n) for n in counts],
        peak,
        clipping_range=privacy.secagg_clipping_range,
        quantization_range=privacy.secagg_quantization_range,
        max_weight=max_weight,
    )
    n = float(sum(counts))
    delta = eps * (1.0 + 2.0 * clip) + eps * eps
    scatter = n * delta  # per entry of outer - n mean mean^T
    trace_share = scatter / max(n - 1.0, 1.0)  # per unit of tau = trace / (n - 1) / d
    entry = (scatter + prior_parts * trace_share) / max(n - 1.0 + prior_parts, 1.0)
    return FitBounds(moments=eps, mean=eps, covariance=dims * entry)

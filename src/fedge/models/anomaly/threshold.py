"""A station's anomaly threshold from its own good parts scored out of sample (pure).

The threshold is a conformal one (split conformal prediction: Vovk, Gammerman & Shafer,
*Algorithmic Learning in a Random World*, 2005; for outliers, Bates et al., "Testing for
outliers with conformal p-values", Ann. Statist. 2023). The ``n`` held-out good parts
were not in the fit, so a new good part's score is exchangeable with theirs: it exceeds
the ``k``-th smallest of them with probability ``(n + 1 - k) / (n + 1)``. Taking
``k = ceil((n + 1) (1 - rate))`` keeps that at most ``rate`` -- in expectation over the
held-out draw, for any score distribution -- and is the smallest such threshold.

With fewer than ``1 / rate - 1`` parts no held-out score is high enough: even the
largest of ``n`` is exceeded with probability ``1 / (n + 1)`` > ``rate``. The station
then sets no threshold and says how many parts it needs (:class:`TooFewPartsError`). The
empirical quantile this replaces took the largest score of any few parts, so a station
with 4 held out got a "5 %" threshold that a fifth of its good parts exceed (seen in
``make demo``: 11 of 16 good parts novel at one station).

A station holds out only a share of its labelled good parts (20 % by default), so a 1 %
threshold would need ~500 labelled to hold 99 out. Its other good parts were in the fit,
where their own scores are too low; :func:`leave_one_out_scores` scores each under the
fleet's fit *without it* (its statistics subtracted from the fleet's sums, which is
exact), an out-of-sample score as the held-out ones are. Pooling both is the jackknife
(Barber, Candès, Ramdas & Tibshirani, "Predictive inference with the jackknife+", Ann.
Statist. 2021). It has no guarantee for every fit, only for stable ones: a part's score
under the fit without it must be near its score under a fit with it replaced by a new
part. A fleet fit on hundreds of parts with shrinkage is such a fit; ``fedge bench
anomaly`` measures the false-alarm rate that results (BENCHMARKS.md §28).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedge.models.anomaly import StatisticsError
from fedge.models.anomaly.statistics import (
    DEFAULT_PRIOR_PARTS,
    DEFAULT_RIDGE,
    Float64Array,
    SufficientStatistics,
    fit,
    mahalanobis,
)


class TooFewPartsError(StatisticsError):
    """Too few good parts scored out of sample for a threshold at the rate asked."""


@dataclass(frozen=True)
class AnomalyThreshold:
    """A recommended threshold, the rate it targets, and what it rests on."""

    threshold: float
    false_alarm_rate: float
    parts: int
    """The good parts scored out of sample it rests on."""
    false_alarms: int
    """Of those, the ones scoring above the threshold."""

    @property
    def false_alarm_bound(self) -> float:
        """The chance that a new good part scores above the threshold (module docstring):
        at most ``false_alarm_rate``."""
        rank = conformal_rank(self.parts, self.false_alarm_rate)
        return (self.parts + 1 - rank) / (self.parts + 1)


def min_parts_for(false_alarm_rate: float) -> int:
    """The fewest good parts scored out of sample that can set a threshold at
    ``false_alarm_rate``."""
    _check_rate(false_alarm_rate)
    return max(1, math.ceil((1.0 - false_alarm_rate) / false_alarm_rate - 1e-9))


def conformal_rank(parts: int, false_alarm_rate: float) -> int:
    """``k = ceil((n + 1) (1 - rate))``: the threshold is the k-th smallest of ``parts``
    out-of-sample scores (it may exceed ``parts``: then there is no threshold)."""
    return math.ceil((parts + 1) * (1.0 - false_alarm_rate) - 1e-9)


def threshold_for_rate(scores: Float64Array, false_alarm_rate: float) -> AnomalyThreshold:
    """The conformal threshold at ``false_alarm_rate`` from good parts' out-of-sample
    ``scores``."""
    _check_rate(false_alarm_rate)
    values = np.sort(np.asarray(scores, dtype=np.float64).ravel())
    if values.size == 0:
        raise StatisticsError("no held-out good parts to set a threshold on; keep some aside")
    if not np.all(np.isfinite(values)):
        raise StatisticsError("held-out scores hold NaN or infinity")
    rank = conformal_rank(int(values.size), false_alarm_rate)
    if rank > values.size:
        needed = min_parts_for(false_alarm_rate)
        raise TooFewPartsError(
            f"{values.size} good part(s) scored out of sample (held out, or left out of the "
            f"fit) cannot set a threshold at a {false_alarm_rate:.3g} false-alarm rate: a "
            f"good part would score above the largest of them with probability "
            f"1/{values.size + 1}; it needs at least {needed} (label more parts good, or "
            "ask for a higher rate)"
        )
    threshold = float(values[rank - 1])
    return AnomalyThreshold(
        threshold=threshold,
        false_alarm_rate=false_alarm_rate,
        parts=int(values.size),
        false_alarms=int(np.sum(values > threshold)),
    )


def leave_one_out_scores(
    pooled: SufficientStatistics,
    features: Float64Array,
    *,
    scored: Float64Array | None = None,
    prior_parts: float = DEFAULT_PRIOR_PARTS,
    ridge: float = DEFAULT_RIDGE,
) -> Float64Array:
    """Each part's score (the largest Mahalanobis distance over locations) under the fit of
    ``pooled`` without that part: ``features`` ``(n, L, d)`` are parts that are *in*
    ``pooled`` as they were summed (clipped, if the fit's were), and each is taken out of
    the sums before the fit (module docstring); ``scored`` are the same parts' features as
    the served model sees them (unclipped; default ``features``). ``prior_parts`` and
    ``ridge`` are the fit's own."""
    x = np.asarray(features, dtype=np.float64)
    seen = x if scored is None else np.asarray(scored, dtype=np.float64)
    if x.ndim != 3 or x.shape[1:] != pooled.total.shape or seen.shape != x.shape:
        raise StatisticsError(
            f"features must be [n, {pooled.total.shape[0]}, {pooled.dims}] like the fit's, "
            f"got {x.shape} (scored: {seen.shape})"
        )
    if x.shape[0] > pooled.count - 1:
        raise StatisticsError(
            f"{x.shape[0]} parts cannot each be left out of a fit of {pooled.count}: "
            "the rest must hold at least one"
        )
    scores = np.empty(x.shape[0], dtype=np.float64)
    for index, part in enumerate(x):
        without = SufficientStatistics(
            count=pooled.count - 1,
            total=pooled.total - part,
            outer=pooled.outer - np.einsum("ld,le->lde", part, part),
            grid=pooled.grid,
        )
        model = fit(without, prior_parts=prior_parts, ridge=ridge)
        scores[index] = float(mahalanobis(model, seen[index][None]).max())
    return scores


def _check_rate(false_alarm_rate: float) -> None:
    if not (0.0 < false_alarm_rate < 1.0):
        raise StatisticsError(f"the false-alarm rate must be in (0, 1), got {false_alarm_rate}")

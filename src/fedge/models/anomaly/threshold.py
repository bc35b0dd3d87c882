"""A station's anomaly threshold from its own held-out good parts (pure).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedge.models.anomaly import StatisticsError
from fedge.models.anomaly.statistics import Float64Array


class TooFewPartsError(StatisticsError):
    """Too few held-out good parts for a threshold at the rate asked."""


@dataclass(frozen=True)
class AnomalyThreshold:
    """A recommended threshold, the rate it targets, and what it rests on."""

    threshold: float
    false_alarm_rate: float
    held_out_parts: int
    held_out_false_alarms: int
    """Held-out good parts scoring above the threshold."""

    @property
    def false_alarm_bound(self) -> float:
        """The chance that a new good part scores above the threshold (module docstring):
        at most ``false_alarm_rate``."""
        rank = conformal_rank(self.held_out_parts, self.false_alarm_rate)
        return (self.held_out_parts + 1 - rank) / (self.held_out_parts + 1)


def min_parts_for(false_alarm_rate: float) -> int:
    """The fewest held-out good parts that can set a threshold at ``false_alarm_rate``."""
    _check_rate(false_alarm_rate)
    return max(1, math.ceil((1.0 - false_alarm_rate) / false_alarm_rate - 1e-9))


def conformal_rank(parts: int, false_alarm_rate: float) -> int:
    """``k = ceil((n + 1) (1 - rate))``: the threshold is the k-th smallest of ``parts``
    held-out scores (it may exceed ``parts``: then there is no threshold)."""
    return math.ceil((parts + 1) * (1.0 - false_alarm_rate) - 1e-9)


def threshold_for_rate(scores: Float64Array, false_alarm_rate: float) -> AnomalyThreshold:
    """The conformal threshold at ``false_alarm_rate`` from held-out good parts' ``scores``."""
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
            f"{values.size} held-out good part(s) cannot set a threshold at a "
            f"{false_alarm_rate:.3g} false-alarm rate: a good part would score above the "
            f"largest of them with probability 1/{values.size + 1}; it needs at least "
            f"{needed} (label more parts good, or ask for a higher rate)"
        )
    threshold = float(values[rank - 1])
    return AnomalyThreshold(
        threshold=threshold,
        false_alarm_rate=false_alarm_rate,
        held_out_parts=int(values.size),
        held_out_false_alarms=int(np.sum(values > threshold)),
    )


def _check_rate(false_alarm_rate: float) -> None:
    if not (0.0 < false_alarm_rate < 1.0):
        raise StatisticsError(f"the false-alarm rate must be in (0, 1), got {false_alarm_rate}")

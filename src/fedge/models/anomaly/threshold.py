"""A station's anomaly threshold from its own held-out good parts (pure).

The threshold is the score quantile at ``1 - false_alarm_rate``: on parts like the held-out
good ones, that fraction scores above it. The quantile is the empirical one taken upward
(the smallest held-out score with at most ``rate * n`` above it), so the false-alarm rate
on the held-out parts never exceeds the target; with fewer than ``1 / rate`` parts that is
the largest score, and the report says how many parts it rests on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedge.models.anomaly import StatisticsError
from fedge.models.anomaly.statistics import Float64Array


@dataclass(frozen=True)
class AnomalyThreshold:
    """A recommended threshold, the rate it targets, and what it rests on."""

    threshold: float
    false_alarm_rate: float
    held_out_parts: int
    held_out_false_alarms: int
    """Held-out good parts scoring above the threshold (<= rate * parts)."""


def threshold_for_rate(scores: Float64Array, false_alarm_rate: float) -> AnomalyThreshold:
    """The threshold at ``false_alarm_rate`` from held-out good parts' ``scores``."""
    if not (0.0 < false_alarm_rate < 1.0):
        raise StatisticsError(f"the false-alarm rate must be in (0, 1), got {false_alarm_rate}")
    values = np.sort(np.asarray(scores, dtype=np.float64).ravel())
    if values.size == 0:
        raise StatisticsError("no held-out good parts to set a threshold on; keep some aside")
    if not np.all(np.isfinite(values)):
        raise StatisticsError("held-out scores hold NaN or infinity")
    allowed = math.floor(false_alarm_rate * values.size + 1e-9)
    threshold = float(values[values.size - 1 - allowed])
    above = int(np.sum(values > threshold))
    return AnomalyThreshold(
        threshold=threshold,
        false_alarm_rate=false_alarm_rate,
        held_out_parts=int(values.size),
        held_out_false_alarms=above,
    )

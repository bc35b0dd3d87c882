"""How often fresh good parts exceed a station's anomaly threshold, by the rule that set it.

Part of ``fedge bench anomaly`` (issue 28, item 4). Every station of the bench's fleet
holds out, beside the good parts it summed into the fleet's fit, a quarter as many more
(20 % of its labelled good parts, the agent's default ``holdout_percent``), and sets its
threshold at each rate in :data:`RATES` three ways:

- ``empirical_held_out``: the rule fedge used before: the held-out scores' empirical
  quantile, the largest score when there are fewer than ``1 / rate`` of them;
- ``conformal_held_out``: the conformal rank on the held-out scores alone (none when
  they are too few: :func:`fedge.models.anomaly.threshold.min_parts_for`);
- ``conformal_with_left_out``: the conformal rank on the held-out scores and the
  station's training parts each scored under the fleet's fit without it (what a station
  reports now, :func:`fedge.party.anomaly_round.threshold_round`).

Each threshold's false-alarm rate is measured on the same fresh good parts (the bench's
held-out test set, which no station saw). Pure NumPy over the bench's features.
"""

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from fedge.models.anomaly.statistics import GaussianFit, SufficientStatistics, mahalanobis
from fedge.models.anomaly.threshold import (
    TooFewPartsError,
    leave_one_out_scores,
    threshold_for_rate,
)

RATES = (0.05, 0.01)
HOLDOUT_SHARE = 0.2  # of a station's labelled good parts (agent.toml's holdout_percent)

Features = npt.NDArray[np.float64]


def empirical_threshold(scores: Features, rate: float) -> float:
    """The rule fedge used before the conformal one: at most ``rate * n`` held-out scores
    above it, so the largest of fewer than ``1 / rate``."""
    values = np.sort(scores)
    allowed = math.floor(rate * values.size + 1e-9)
    return float(values[values.size - 1 - allowed])


def threshold_false_alarms(
    fleet: GaussianFit,
    summed: SufficientStatistics,
    trained: list[Features],
    held_out: list[Features],
    fresh_good: Features,
) -> dict[str, Any]:
    """Per rate and station (named by its training parts): each rule's false-alarm rate on
    ``fresh_good`` and the parts it rested on. ``trained[i]`` are station i's parts in
    ``summed`` (the fit of which is ``fleet``), ``held_out[i]`` its held-out good parts."""
    fresh = mahalanobis(fleet, fresh_good).max(axis=1)
    out: dict[str, Any] = {"fresh_good_parts": int(fresh.size)}
    for rate in RATES:
        stations: dict[str, Any] = {}
        for mine, held in zip(trained, held_out, strict=True):
            held_scores = mahalanobis(fleet, held).max(axis=1)
            left_out = leave_one_out_scores(summed, mine)
            rules: dict[str, float | None] = {
                "empirical_held_out": empirical_threshold(held_scores, rate),
                "conformal_held_out": _conformal(held_scores, rate),
                "conformal_with_left_out": _conformal(
                    np.concatenate([held_scores, left_out]), rate
                ),
            }
            stations[str(len(mine))] = {
                "held_out": int(held.shape[0]),
                "left_out": int(left_out.size),
                "false_alarm_rate": {
                    rule: None if value is None else round(float(np.mean(fresh > value)), 4)
                    for rule, value in rules.items()
                },
            }
        out[f"{rate:g}"] = stations
    return out


def _conformal(scores: Features, rate: float) -> float | None:
    try:
        return threshold_for_rate(scores, rate).threshold
    except TooFewPartsError:
        return None


def over_seeds(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean false-alarm rate over seeds of each rule at each rate and station (the
    guarantee is an expectation over the held-out draw), and in how many seeds the rule
    set no threshold."""
    first = per_seed[0]
    out: dict[str, Any] = {"seeds": len(per_seed), "statistic": "mean over seeds"}
    for rate in (key for key in first if key != "fresh_good_parts"):
        stations: dict[str, Any] = {}
        for station, entry in first[rate].items():
            rules: dict[str, Any] = {}
            for rule in entry["false_alarm_rate"]:
                values = [run[rate][station]["false_alarm_rate"][rule] for run in per_seed]
                measured = [v for v in values if v is not None]
                rules[rule] = {
                    "mean": round(float(np.mean(measured)), 4) if measured else None,
                    "no_threshold_seeds": len(values) - len(measured),
                }
            stations[station] = {
                "held_out": entry["held_out"],
                "left_out": entry["left_out"],
                "false_alarm_rate": rules,
            }
        out[rate] = stations
    return out

"""The ``novel_rate`` finding (issue 28): novel parts arriving faster than chance, pure.

A part is *novel* when the anomaly model served beside the classifier scored it over the
station's anomaly threshold and the classifier did not recognise it as a known defect
(called it clean, or rejected it without confidence: ``PredictionRecord.novel``). The
threshold is the station's score quantile at a target false-alarm rate on its held-out
good parts (1 % by default), so good parts alone are novel at about that rate; a new
defect type raises it. The question "has the rate gone up?" is a change-point question,
answered here by Page's CUSUM for Bernoulli observations (Page, Biometrika 1954;
Reynolds & Stoumbos, J. Quality Technology 1999): over the window's predictions, oldest
first,

    S_t = max(0, S_{t-1} + x_t * log(p1/p0) + (1 - x_t) * log((1 - p1)/(1 - p0)))

with ``x_t`` 1 for a novel part, ``p0`` the in-control rate (the threshold's false-alarm
rate) and ``p1`` the rate to catch (10 %: the issue's new defect). The alert holds while ``S``
reached ``limit`` anywhere in the window -- the monitor ticks after batches of parts, and
a crossing inside a batch counts -- and clears once that crossing has left the window (a
whole window without one: the drift alerts' off-delay). Each novel part adds
log(p1/p0) = 2.3 and each clean one takes 0.095 away, so at the defaults three novel
parts close together fire it and two do not -- one isolated false alarm of the threshold
never does. The CUSUM reads only the monitor's current window (its newest
``min_window`` predictions): a bounded read, and old parts age out of it.

Why not the window's rate against a fixed line: a line low enough to catch 10 % within
30 parts fires on every second burst of two good-part false alarms, and one high enough
not to waits for the whole window; the CUSUM is the quickest detector of a rate shift
for a given false-alarm run length (Moustakides, Ann. Statist. 1986).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fedge.edge_manager.monitor.rules import Finding, NovelPolicy
from fedge.protocols.alerts import AlertKind


def cusum(novel: Sequence[bool], policy: NovelPolicy) -> tuple[float, float]:
    """Page's Bernoulli CUSUM over ``novel`` (oldest first), from 0: its value at the
    last part, and the highest it reached."""
    p0, p1 = policy.in_control_rate, policy.alarm_rate
    up, down = math.log(p1 / p0), math.log((1 - p1) / (1 - p0))
    statistic = peak = 0.0
    for flag in novel:
        statistic = max(0.0, statistic + (up if flag else down))
        peak = max(peak, statistic)
    return statistic, peak


def novel_finding(novel: Sequence[bool | None], policy: NovelPolicy) -> Finding:
    """The ``novel_rate`` finding over a window (oldest first): per prediction, whether
    it was novel, or None where no anomaly verdict was made (no anomaly model served,
    or no anomaly threshold set) -- those are left out, and a window with fewer than
    ``min_judged`` verdicts is not judged."""
    judged = [flag for flag in novel if flag is not None]
    count = sum(judged)
    rate = count / len(judged) if judged else 0.0
    detail = {
        "novel": count,
        "judged": len(judged),
        "in_control_rate": policy.in_control_rate,
        "alarm_rate": policy.alarm_rate,
        "limit": policy.limit,
        "rule": "Page's Bernoulli CUSUM over the window's parts with an anomaly verdict",
    }
    if len(judged) < policy.min_judged:
        detail["reason"] = (
            f"{len(judged)} parts with an anomaly verdict, {policy.min_judged} needed "
            "(is an anomaly model deployed beside the classifier, and an anomaly "
            "threshold set? fedge edge set-threshold EDGE --anomaly)"
        )
        return Finding(AlertKind.NOVEL_RATE, None, rate, policy.alarm_rate, detail)
    statistic, peak = cusum(judged, policy)
    detail["cusum"] = round(statistic, 4)
    detail["cusum_peak"] = round(peak, 4)
    return Finding(AlertKind.NOVEL_RATE, peak >= policy.limit, rate, policy.alarm_rate, detail)

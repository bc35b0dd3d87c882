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
whole window without one: the drift alerts' off-delay). The CUSUM reads only the
monitor's current window (its newest ``min_window`` predictions): a bounded read, and old
parts age out of it.

Graded evidence. How far over the threshold a part scores says more than that it is
over: good parts' false alarms sit just over it (on the anomaly bench's seed-1 models,
every one within 1.16x), a new defect mostly well over (dents a median 1.7x; 63 % over
1.5x; BENCHMARKS.md §22). So a part has one of three outcomes -- not novel, novel, or
*strongly* novel (scored ``strong_multiple`` times the threshold or more) -- and the
CUSUM adds each outcome's log-likelihood ratio (the CUSUM of any two observation
distributions: Basseville & Nikiforov, "Detection of Abrupt Changes", 1993, ch. 2). In
control, strongly novel parts are ``in_control_strong_share`` of the novel ones
(p0s = 0.1 %, a prior the data above does not contradict: none of its false alarms were);
among the parts to catch, ``alarm_strong_share`` (p1s = 5 %). At the defaults a strongly
novel part adds log(0.05/0.001) = 3.9, a novel one log(0.05/0.009) = 1.7, a clean one
takes 0.095 away: two strongly novel parts within 30 fire it, or one with a novel part
within 7, while just-over false alarms need three within four parts (or four within 23).

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

NOT_NOVEL, NOVEL, STRONGLY_NOVEL = 0, 1, 2


def grade(
    novel: bool | None, score: float | None, threshold: float | None, policy: NovelPolicy
) -> int | None:
    """A part's outcome for the CUSUM: None (no verdict), NOT_NOVEL, NOVEL, or
    STRONGLY_NOVEL (novel, and scored ``strong_multiple`` times a positive threshold or
    more; a part whose threshold is not known is NOVEL)."""
    if novel is None:
        return None
    if not novel:
        return NOT_NOVEL
    if score is not None and threshold and score >= policy.strong_multiple * threshold:
        return STRONGLY_NOVEL
    return NOVEL


def _increments(policy: NovelPolicy) -> tuple[float, float, float]:
    """The log-likelihood ratios of NOT_NOVEL, NOVEL and STRONGLY_NOVEL."""
    p0, p1 = policy.in_control_rate, policy.alarm_rate
    p0s, p1s = p0 * policy.in_control_strong_share, p1 * policy.alarm_strong_share
    return (
        math.log((1 - p1) / (1 - p0)),
        math.log((p1 - p1s) / (p0 - p0s)),
        math.log(p1s / p0s),
    )


def cusum(novel: Sequence[int], policy: NovelPolicy) -> tuple[float, float]:
    """Page's CUSUM over the outcomes ``novel`` (oldest first), from 0: its value at the
    last part, and the highest it reached."""
    steps = _increments(policy)
    statistic = peak = 0.0
    for outcome in novel:
        statistic = max(0.0, statistic + steps[int(outcome)])
        peak = max(peak, statistic)
    return statistic, peak


def novel_finding(novel: Sequence[int | None], policy: NovelPolicy) -> Finding:
    """The ``novel_rate`` finding over a window (oldest first): per prediction, its
    outcome (:func:`grade`), or None where no anomaly verdict was made (no anomaly model
    served, or no anomaly threshold set) -- those are left out, and a window with fewer
    than ``min_judged`` verdicts is not judged."""
    judged = [outcome for outcome in novel if outcome is not None]
    count = sum(outcome != NOT_NOVEL for outcome in judged)
    rate = count / len(judged) if judged else 0.0
    detail = {
        "novel": count,
        "strongly_novel": sum(outcome == STRONGLY_NOVEL for outcome in judged),
        "judged": len(judged),
        "in_control_rate": policy.in_control_rate,
        "alarm_rate": policy.alarm_rate,
        "limit": policy.limit,
        "rule": (
            "Page's CUSUM over the window's parts with an anomaly verdict: not novel, "
            f"novel, or strongly novel (at least {policy.strong_multiple}x the threshold)"
        ),
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

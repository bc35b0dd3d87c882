"""The validation gate's verdict: is a candidate model blessed? (pure)

Model validation as TFX does it (Baylor et al., "TFX: A TensorFlow-Based Production-Scale
Machine Learning Platform", KDD'17; the Evaluator's "blessing"): a candidate replaces the
serving model only if it is at least as good on held-out data -- here per station, since a
model that is better on average can still miss scratches on one line. The stations score
their held-out labelled images with both models (images never leave them); this module
turns those scores and the *manager's* current labels into the evidence and the verdict:

- per station: accuracy (top-1 class = label) of the candidate and of the reference on
  the same images; the station fails when the candidate is worse by more than
  ``max_station_drop``;
- overall (every usable station pooled): the candidate must be better than the
  reference, strictly when ``min_overall_gain`` is 0, by at least that gain otherwise;
- blessed only if no usable station fails and the overall rule holds.

The reference of a station is the model it serves. A station that serves nothing is
compared with the majority-class baseline (always predict the most common label of the
held-out set): with no serving model anywhere, which is how a fleet's first model is
gated, the candidate must beat that constant, as TFX's first run is judged on absolute
thresholds only. A broken first model (all "clean") is then not blessed.

Only the held-out images as they are count: the re-lit copies a station also scores
(``Scored.augmented``) train the label-free accuracy predictor, not the verdict.

Stations with fewer than ``min_examples`` labelled examples, stations whose evaluation
failed, stations that did not answer and edges left out (they serve the candidate
already: ``gating.py``) are listed with the reason, never silently used; if no station is
usable the candidate is not blessed.

The evidence also recommends thresholds for the candidate: per positive class, the
highest score threshold that still catches ``target_recall`` of the held-out images
labelled with that class (a ``reject`` is ``score >= threshold``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fedge.edge_manager.errors import ManagerError

# Accuracies are ratios of counts: compare with a little slack for float rounding.
_EPS = 1e-9


class GatePolicyError(ManagerError):
    """A gate policy value is out of range (the message names it)."""


@dataclass(frozen=True)
class GatePolicy:
    max_station_drop: float = 0.02
    min_overall_gain: float = 0.0
    min_examples: int = 20
    target_recall: float = 0.95

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_station_drop) and 0.0 <= self.max_station_drop <= 1.0):
            raise GatePolicyError(f"max drop must be in [0, 1], got {self.max_station_drop}")
        if not (math.isfinite(self.min_overall_gain) and 0.0 <= self.min_overall_gain <= 1.0):
            raise GatePolicyError(f"min gain must be in [0, 1], got {self.min_overall_gain}")
        if not 1 <= self.min_examples <= 1_000_000:
            raise GatePolicyError(f"min examples must be >= 1, got {self.min_examples}")
        if not (math.isfinite(self.target_recall) and 0.0 < self.target_recall <= 1.0):
            raise GatePolicyError(f"target recall must be in (0, 1], got {self.target_recall}")


@dataclass(frozen=True)
class Scored:
    """One model's scores on one held-out image, as a station reported them."""

    prediction_id: str
    model: str
    label: str  # the station's label (the verdict uses the manager's)
    scores: Mapping[str, float]
    augmented: int = 0  # k >= 1: a re-lit copy (trains MPP; never judges a model)


@dataclass(frozen=True)
class StationReport:
    """What one station answered (``status`` done, failed, or missing: no answer; or
    left_out: not asked, ``reason`` says why). ``foreign_items``/``rejected_items``: the
    items the manager dropped from its report (images of other stations' predictions;
    scores not of the model's classes), ``dropped_reason`` says which."""

    edge: str
    serving: str | None
    status: str
    reason: str = ""
    holdout: int = 0
    items: tuple[Scored, ...] = ()
    foreign_items: int = 0
    rejected_items: int = 0
    dropped_reason: str = ""


@dataclass(frozen=True)
class StationEvidence:
    edge: str
    status: str
    serving: str | None
    reference: str  # the serving model's ref, or "majority class 'clean'"
    examples: int
    holdout: int
    serving_accuracy: float | None  # the reference's accuracy
    candidate_accuracy: float | None
    delta: float | None
    passed: bool | None  # None: not used in the verdict (see reason)
    reason: str
    unlabelled: int = 0  # scored images the manager has no label for (left out)
    label_disagreements: int = 0  # the station's label differs from the manager's
    foreign_items: int = 0  # report items on other stations' predictions (dropped)
    rejected_items: int = 0  # report items with scores not of the model's classes (dropped)
    dropped_reason: str = ""  # why the manager dropped items of the report ("": none)


@dataclass(frozen=True)
class Overall:
    examples: int
    serving_accuracy: float | None
    candidate_accuracy: float | None
    gain: float | None


@dataclass(frozen=True)
class Verdict:
    candidate: str
    blessed: bool
    reason: str
    stations: tuple[StationEvidence, ...]
    overall: Overall
    policy: GatePolicy
    recommended_thresholds: dict[str, Any] | None
    threshold_basis: dict[str, Any]

    @property
    def failed_stations(self) -> tuple[str, ...]:
        return tuple(s.edge for s in self.stations if s.passed is False)

    def evidence(self) -> dict[str, Any]:
        """JSON-ready evidence, stored with the verdict in ``gate_results``."""
        return {
            "candidate": self.candidate,
            "blessed": self.blessed,
            "reason": self.reason,
            "failed_stations": list(self.failed_stations),
            "stations": [asdict(s) for s in self.stations],
            "overall": asdict(self.overall),
            "policy": asdict(self.policy),
            "recommended_thresholds": self.recommended_thresholds,
            "threshold_basis": self.threshold_basis,
        }


def top_class(scores: Mapping[str, float]) -> str:
    """The predicted class: the highest score (ties to the first name alphabetically)."""
    return min(scores, key=lambda name: (-scores[name], name))


def majority_label(labels: Sequence[str]) -> str | None:
    counts = Counter(labels)
    if not counts:
        return None
    return min(counts, key=lambda label: (-counts[label], label))


def _ratio(part: int, whole: int) -> float | None:
    return None if whole == 0 else part / whole


@dataclass(frozen=True)
class _Tally:
    examples: int
    candidate_correct: int
    reference_correct: int


def _station_examples(
    report: StationReport, candidate: str, labels: Mapping[str, str]
) -> tuple[list[tuple[Scored, Scored | None, str]], int, int]:
    """(candidate item, reference item or None, manager label) per usable image,
    the candidate's images without a manager label, and label disagreements."""
    by_model: dict[str, dict[str, Scored]] = {}
    for item in report.items:
        if item.augmented:
            continue  # the held-out images as they are decide; synthetic copies do not
        by_model.setdefault(item.model, {})[item.prediction_id] = item
    ours = by_model.get(candidate, {})
    reference = None if report.serving is None else by_model.get(report.serving, {})
    examples: list[tuple[Scored, Scored | None, str]] = []
    unlabelled = disagreements = 0
    for prediction_id, item in sorted(ours.items()):
        label = labels.get(prediction_id)
        if label is None:
            unlabelled += 1
            continue
        disagreements += item.label != label
        ref_item = None if reference is None else reference.get(prediction_id)
        if reference is not None and ref_item is None:
            continue  # the reference did not score it: no like-for-like comparison
        examples.append((item, ref_item, label))
    return examples, unlabelled, disagreements


def judge(
    candidate: str,
    stations: Sequence[StationReport],
    labels: Mapping[str, str],
    policy: GatePolicy,
    positive_classes: Sequence[str] = (),
) -> Verdict:
    """The verdict on ``candidate`` from the stations' reports and the manager's labels
    (prediction id -> current label)."""
    answered = [s for s in stations if s.status == "done"]
    per_station = {s.edge: _station_examples(s, candidate, labels) for s in answered}
    # The majority-class baseline, for stations that serve no model.
    majority = majority_label([label for ex, _, _ in per_station.values() for *_, label in ex])
    evidence: list[StationEvidence] = []
    tallies: list[_Tally] = []
    for station in sorted(stations, key=lambda s: s.edge):
        if station.status != "done":
            evidence.append(_unused(station, station.reason or "no report"))
            continue
        examples, unlabelled, disagreements = per_station[station.edge]
        reference = station.serving or f"majority class {majority!r}"
        n = len(examples)
        ours = sum(top_class(item.scores) == label for item, _, label in examples)
        theirs = sum(
            (top_class(ref.scores) if ref is not None else majority) == label
            for _, ref, label in examples
        )
        cand_acc, ref_acc = _ratio(ours, n), _ratio(theirs, n)
        delta = None if n == 0 else (ours - theirs) / n
        if n < policy.min_examples:
            passed: bool | None = None
            reason = f"too few examples ({n} < {policy.min_examples}): not used"
        else:
            tallies.append(_Tally(n, ours, theirs))
            assert delta is not None
            passed = delta >= -policy.max_station_drop - _EPS
            reason = (
                "within the allowed drop"
                if passed
                else f"worse by {-delta:.3f} (more than {policy.max_station_drop:g})"
            )
        evidence.append(
            StationEvidence(
                station.edge, station.status, station.serving, reference, n, station.holdout,
                ref_acc, cand_acc, delta, passed, reason, unlabelled, disagreements,
                station.foreign_items, station.rejected_items, station.dropped_reason,
            )
        )  # fmt: skip
    overall = _overall(tallies)
    blessed, reason = _decide(evidence, overall, policy)
    scored = [item for ex, _, _ in per_station.values() for item, _, _ in ex]
    thresholds, basis = recommend_thresholds(
        [(item.scores, labels[item.prediction_id]) for item in scored],
        positive_classes,
        policy.target_recall,
    )
    return Verdict(candidate, blessed, reason, tuple(evidence), overall, policy, thresholds, basis)


def _unused(station: StationReport, why: str) -> StationEvidence:
    prefix = {"failed": "evaluation failed: "}.get(station.status, "")
    return StationEvidence(
        station.edge, station.status, station.serving, station.serving or "-", 0,
        station.holdout, None, None, None, None, f"{prefix}{why}: not used",
    )  # fmt: skip


def _overall(tallies: Sequence[_Tally]) -> Overall:
    n = sum(t.examples for t in tallies)
    ours = sum(t.candidate_correct for t in tallies)
    theirs = sum(t.reference_correct for t in tallies)
    gain = None if n == 0 else (ours - theirs) / n
    return Overall(n, _ratio(theirs, n), _ratio(ours, n), gain)


def _decide(
    stations: Sequence[StationEvidence], overall: Overall, policy: GatePolicy
) -> tuple[bool, str]:
    if overall.examples == 0 or overall.gain is None:
        listed = ", ".join(f"{s.edge} ({s.reason})" for s in stations) or "none"
        return False, f"no station has enough held-out examples to judge: {listed}"
    failed = [s for s in stations if s.passed is False]
    if failed:
        named = ", ".join(f"{s.edge} ({s.delta:+.3f})" for s in failed if s.delta is not None)
        return False, (
            f"worse than the serving model by more than {policy.max_station_drop:g} on {named}"
        )
    gain = overall.gain
    if policy.min_overall_gain == 0.0:
        better, needed = gain > _EPS, "> 0"
    else:
        better = gain >= policy.min_overall_gain - _EPS
        needed = f">= {policy.min_overall_gain:g}"
    summary = (
        f"overall {overall.candidate_accuracy:.3f} vs {overall.serving_accuracy:.3f} "
        f"(gain {gain:+.3f}, needs {needed}) on {overall.examples} examples"
    )
    if not better:
        return False, f"not better overall: {summary}"
    used = sum(s.passed is True for s in stations)
    within = f"within {policy.max_station_drop:g} on {used} station(s)"
    return True, f"better overall: {summary}; {within}"


def recommend_thresholds(
    examples: Sequence[tuple[Mapping[str, float], str]],
    positive_classes: Sequence[str],
    target_recall: float,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Per positive class, the highest threshold that catches ``target_recall`` of the
    images labelled with it: the k-th highest of their scores, k = ceil(recall * n).

    Returns ``{"default_threshold", "class_thresholds"}`` (the manifest's Thresholds
    fields; the default is the lowest class threshold, the most cautious) or None when no
    held-out image carries a positive label, and the basis (counts, recall reached).
    """
    class_thresholds: dict[str, float] = {}
    positives: dict[str, int] = {}
    recall: dict[str, float] = {}
    for name in positive_classes:
        scores = sorted((s.get(name, 0.0) for s, label in examples if label == name), reverse=True)
        positives[name] = len(scores)
        if not scores:
            continue
        k = max(1, math.ceil(target_recall * len(scores) - _EPS))
        # Rounded down: the rounded threshold still catches the k-th image.
        threshold = math.floor(scores[k - 1] * 1e6) / 1e6
        class_thresholds[name] = threshold
        recall[name] = sum(score >= threshold for score in scores) / len(scores)
    basis = {"target_recall": target_recall, "positives": positives, "recall": recall}
    if not class_thresholds:
        return None, basis
    recommended = {
        "default_threshold": min(class_thresholds.values()),
        "class_thresholds": class_thresholds,
    }
    return recommended, basis

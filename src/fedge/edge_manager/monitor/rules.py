"""The monitor's decisions, pure: windows in, findings and alert transitions out.

For one edge and the model it serves, :mod:`fedge.edge_manager.monitor.tick` reads two windows
of what the edge reported -- the model's *reference* (the gate's evaluation of it at that
station, else its first predictions there) and the *current* window (its newest
predictions) -- and this module judges them:

- **input drift**: the image statistics (:data:`fedge.monitoring.features.IMAGE_STATS`)
  of the two windows, by PSI and the KS test (:func:`fedge.monitoring.drift.detect`);
- **score drift**: the score features (top score, margin, entropy) the same way;
- **estimated accuracy**: the MPP predictor's estimate over the current window (Ghanta et
  al., OpML'19), beside the mean top score and, where labels arrived, the true accuracy.

A finding *holds*, does not hold, or cannot be judged (too few values; ``holds is None``),
and :func:`transitions` turns findings and the open alerts into what to do: raise an alert
while its condition holds (once: never a second open alert of the same kind), clear it
once the condition is well clear of its threshold. An operator's acknowledgement silences
a condition until it has cleared once (it is then re-armed).

Clearing has hysteresis, as alarm systems do (ISA-18.2's deadband and off-delay): the
window slides by a few predictions per tick, so a value hovering at its threshold would
otherwise raise and clear on alternate ticks. A drift alert clears only once the condition
has not held over a whole fresh window (every prediction in the current window arrived
after the last tick at which it held; :func:`with_off_delay`) -- not at a lower PSI level:
between two in-distribution windows of 100 images PSI's sampling noise alone is about
(bins - 1) * (1/n + 1/n) = 0.18, so "below half the alert level" would rarely clear. The
accuracy alert clears only when the estimate is at least ``accuracy_clear_margin`` (0.03,
the MPP estimate's target error in distribution) above the minimum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fedge.monitoring.drift import DriftPolicy, FeatureDrift, detect
from fedge.monitoring.features import IMAGE_STATS, score_features
from fedge.monitoring.mpp import MppPredictor, calibration_estimate, feature_row
from fedge.protocols.alerts import AlertKind


@dataclass(frozen=True)
class WindowRow:
    """One scored image as the manager holds it (a prediction or an evaluation row)."""

    scores: Mapping[str, float]
    stats: Mapping[str, float] | None  # None: the agent sent no image statistics
    at: float = 0.0
    label: str | None = None  # the manager's current label, if any


@dataclass(frozen=True)
class NovelPolicy:
    """The ``novel_rate`` CUSUM's parameters (:mod:`fedge.edge_manager.monitor.novel`)."""

    in_control_rate: float = 0.01  # the anomaly threshold's false-alarm rate (p0)
    alarm_rate: float = 0.10  # the rate of novel parts to catch (p1)
    limit: float = 5.0  # the CUSUM's decision limit h
    min_judged: int = 10  # parts with an anomaly verdict before the rate is judged
    # A novel part scored at least this many times the threshold is *strongly* novel,
    # and is this share of the novel parts in control and of those to catch (novel.py).
    strong_multiple: float = 1.5
    in_control_strong_share: float = 0.1
    alarm_strong_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.in_control_rate < self.alarm_rate < 1.0:
            raise ValueError(
                "need 0 < in_control_rate < alarm_rate < 1, got "
                f"{self.in_control_rate} and {self.alarm_rate}"
            )
        if self.limit <= 0 or self.min_judged < 1:
            raise ValueError(f"limit must be > 0 and min_judged >= 1, got {self}")
        if self.strong_multiple <= 1.0 or not (
            0.0 < self.in_control_strong_share < self.alarm_strong_share < 1.0
        ):
            raise ValueError(
                "need strong_multiple > 1 and 0 < in_control_strong_share < "
                f"alarm_strong_share < 1, got {self}"
            )


@dataclass(frozen=True)
class MonitorPolicy:
    drift: DriftPolicy = field(default_factory=DriftPolicy)
    min_estimated_accuracy: float = 0.8
    accuracy_clear_margin: float = 0.03  # the accuracy alert clears at minimum + this
    novel: NovelPolicy = field(default_factory=NovelPolicy)

    @property
    def min_window(self) -> int:
        return self.drift.min_window


@dataclass(frozen=True)
class Finding:
    kind: AlertKind
    holds: bool | None  # None: not judged (too few values); an open alert stays as it is
    value: float
    threshold: float
    detail: Mapping[str, Any]
    # Whether an open alert of this kind may clear (hysteresis, see the module docstring);
    # None: as soon as the condition does not hold.
    cleared: bool | None = None

    @property
    def clears(self) -> bool:
        if self.holds is None:
            return False
        return (not self.holds) if self.cleared is None else self.cleared and not self.holds


@dataclass(frozen=True)
class Estimate:
    """Label-free accuracy over one window (a row of the ``estimates`` table)."""

    window_start: float
    window_end: float
    n: int
    mpp: float | None
    calibration: float | None
    labelled: int
    true_accuracy: float | None
    # What the console draws per window (issue 27, item 8): the window's rejected
    # predictions and the drift judged on it (the largest PSI; None: not judged).
    # Keyword-only, so StoredEstimate's own fields may follow without defaults.
    rejects: int | None = field(default=None, kw_only=True)
    input_drift: float | None = field(default=None, kw_only=True)
    score_drift: float | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class OpenAlert:
    alert_id: str
    kind: AlertKind
    raised_at: float


@dataclass(frozen=True)
class Raise:
    finding: Finding


@dataclass(frozen=True)
class Clear:
    alert_id: str
    kind: AlertKind
    finding: Finding | None  # None: the edge no longer serves the model


@dataclass(frozen=True)
class Rearm:
    """An acknowledged condition stopped holding: it may be raised again."""

    kind: AlertKind


Action = Raise | Clear | Rearm


def predicted_class(scores: Mapping[str, float]) -> str:
    """The class with the highest score (the first of equal ones, in the model's order)."""
    return max(scores, key=lambda name: scores[name])


# ---------------------------------------------------------------- drift


def _image_columns(rows: Sequence[WindowRow]) -> dict[str, list[float]]:
    with_stats = [r.stats for r in rows if r.stats is not None]
    return {name: [float(s[name]) for s in with_stats if name in s] for name in IMAGE_STATS}


def _score_columns(rows: Sequence[WindowRow]) -> dict[str, list[float]]:
    features = [score_features(r.scores) for r in rows if r.scores]
    names = features[0].keys() if features else ()
    return {name: [f[name] for f in features] for name in names}


def _drift_finding(
    kind: AlertKind,
    reference: Mapping[str, Sequence[float]],
    current: Mapping[str, Sequence[float]],
    policy: DriftPolicy,
    context: Mapping[str, Any],
) -> Finding:
    if not reference or not current or not any(reference.values()):
        return Finding(kind, None, 0.0, policy.psi_alert, {**context, "reason": "no values"})
    verdicts = detect(reference, current, policy)
    drifted = [v for v in verdicts if v.drifted]
    judged = [v for v in verdicts if not v.reason]
    detail = {
        **context,
        "drifted": [v.feature for v in drifted],
        "features": [_verdict(v) for v in verdicts],
    }
    if not judged:
        detail["reason"] = verdicts[0].reason if verdicts else "no shared feature"
        return Finding(kind, None, 0.0, policy.psi_alert, detail)
    value = max(v.psi for v in (drifted or judged))
    return Finding(kind, bool(drifted), value, policy.psi_alert, detail)


def _verdict(verdict: FeatureDrift) -> dict[str, Any]:
    return {
        "feature": verdict.feature,
        "psi": round(verdict.psi, 6),
        "p_value": float(f"{verdict.p_value:.6g}"),
        "drifted": verdict.drifted,
    }


@dataclass(frozen=True)
class Columns:
    """A window's drift inputs: image statistics and score features, per feature."""

    image: Mapping[str, Sequence[float]]
    score: Mapping[str, Sequence[float]]
    n: int


def columns(rows: Sequence[WindowRow]) -> Columns:
    """What :func:`drift_findings` compares; a reference's is computed once and kept
    (a gate reference holds thousands of rows)."""
    return Columns(_image_columns(rows), _score_columns(rows), len(rows))


def drift_findings(
    reference: Sequence[WindowRow] | Columns,
    current: Sequence[WindowRow],
    policy: DriftPolicy,
    *,
    reference_source: str,
) -> list[Finding]:
    """Input drift (image statistics) and score drift of ``current`` against ``reference``."""
    ref = reference if isinstance(reference, Columns) else columns(reference)
    context = {
        "reference": reference_source,
        "reference_n": ref.n,
        "current_n": len(current),
        "current_start": min((r.at for r in current), default=0.0),
        "current_end": max((r.at for r in current), default=0.0),
    }
    return [
        _drift_finding(AlertKind.INPUT_DRIFT, ref.image, _image_columns(current), policy, context),
        _drift_finding(AlertKind.SCORE_DRIFT, ref.score, _score_columns(current), policy, context),
    ]


def with_off_delay(finding: Finding, fresh: int, window: int) -> Finding:
    """``finding`` that may clear only if ``fresh`` -- the current window's predictions
    newer than the last time the condition held -- is a whole ``window``."""
    if finding.holds is not False:
        return finding
    return replace(finding, cleared=fresh >= window)


# ---------------------------------------------------------------- accuracy


def mpp_training_set(rows: Sequence[WindowRow]) -> tuple[list[list[float]], list[bool]]:
    """Feature rows and correctness (argmax == the row's label) of labelled rows with
    image statistics; the others cannot train the predictor and are left out. The
    monitor passes the gate's rows and the stations' re-lit copies of them (labelled
    like their image): copies show the predictor how correctness falls as lighting
    changes, where in-distribution rows alone leave it to extrapolate."""
    features: list[list[float]] = []
    correct: list[bool] = []
    for row in rows:
        if row.label is None or row.stats is None or not row.scores:
            continue
        try:
            features.append(feature_row(row.scores, row.stats))
        except ValueError:
            continue
        correct.append(predicted_class(row.scores) == row.label)
    return features, correct


def estimate(rows: Sequence[WindowRow], predictor: MppPredictor | None) -> Estimate:
    """MPP and calibration estimates over ``rows``, and their accuracy where labelled."""
    scored = [r for r in rows if r.scores]
    labelled = [r for r in scored if r.label is not None]
    feature_rows = []
    for row in scored:
        if row.stats is None:
            continue
        try:
            feature_rows.append(feature_row(row.scores, row.stats))
        except ValueError:
            continue
    mpp = predictor.estimate(feature_rows) if predictor is not None and feature_rows else None
    return Estimate(
        window_start=min((r.at for r in rows), default=0.0),
        window_end=max((r.at for r in rows), default=0.0),
        n=len(rows),
        mpp=mpp,
        calibration=calibration_estimate([r.scores for r in scored]) if scored else None,
        labelled=len(labelled),
        true_accuracy=(
            sum(predicted_class(r.scores) == r.label for r in labelled) / len(labelled)
            if labelled
            else None
        ),
    )


def accuracy_finding(result: Estimate, minimum: float, clear_margin: float = 0.03) -> Finding:
    """The estimated accuracy below ``minimum`` (not judged without an MPP estimate); an
    open alert clears at ``minimum + clear_margin``."""
    detail: dict[str, Any] = {
        "window_start": result.window_start,
        "window_end": result.window_end,
        "n": result.n,
        "mpp": result.mpp,
        "calibration": result.calibration,
        "labelled": result.labelled,
        "true_accuracy": result.true_accuracy,
    }
    if result.mpp is None:
        detail["reason"] = "no MPP predictor for this model (the gate has not evaluated it)"
        return Finding(AlertKind.ACCURACY_ESTIMATE, None, 0.0, minimum, detail)
    return Finding(
        AlertKind.ACCURACY_ESTIMATE,
        result.mpp < minimum,
        result.mpp,
        minimum,
        detail,
        result.mpp >= minimum + clear_margin,
    )


# ---------------------------------------------------------------- alert transitions


def transitions(
    open_alerts: Mapping[AlertKind, OpenAlert],
    acknowledged: frozenset[AlertKind],
    findings: Sequence[Finding],
) -> list[Action]:
    """What to do about ``findings`` given the open alerts and the unre-armed
    acknowledgements of one (edge, model)."""
    actions: list[Action] = []
    for finding in findings:
        current = open_alerts.get(finding.kind)
        if finding.holds is None:
            continue
        if finding.holds:
            if current is None and finding.kind not in acknowledged:
                actions.append(Raise(finding))
            continue
        if not finding.clears:
            continue  # in the deadband: an open alert stays open, an acknowledged one silent
        if current is not None:
            actions.append(Clear(current.alert_id, finding.kind, finding))
        if finding.kind in acknowledged:
            actions.append(Rearm(finding.kind))
    return actions

"""Label-free accuracy: a secondary model that predicts whether the primary one is right.

MPP (Ghanta et al., "ML Health: Fitness Tracking for Production Models", OpML'19) trains
a second model on held-out labelled data to predict, from what is seen at inference time,
whether the primary model's prediction is correct; over a window of unlabelled
predictions, the mean predicted probability of "correct" estimates the primary model's
accuracy. Here the features are the score features (top score, margin, entropy) and the
image statistics of :mod:`fedge.monitoring.features` (:func:`feature_row`); the held-out
set is the validation gate's (the ``evaluations`` table).

The secondary model is an L2-regularised logistic regression on standardised features,
fitted by Newton's method in NumPy: the manager loads it from its store and runs without
scikit-learn, and the JSON form (:meth:`MppPredictor.to_json`) is its plain coefficients,
never a pickle. Logistic regression with an unpenalised intercept is calibrated in the
large: on the data it was fitted on, its mean predicted probability *equals* the observed
accuracy (the intercept's score equation), which is exactly the quantity MPP averages.
One derived input, ``-log(1 - top)`` (how close to certain), lets a linear model follow
how sharply errors thin out as the top score nears 1 (see :data:`DESIGN`).

Beside it, two baselines need no secondary model: the mean top score
(:func:`calibration_estimate`, the confidence baseline of Hendrycks & Gimpel, "A Baseline
for Detecting Misclassified and Out-of-Distribution Examples", ICLR'17) and the average
thresholded confidence (:meth:`MppPredictor.estimate_atc`; Garg et al., "Leveraging
Unlabeled Data to Predict Out-of-Distribution Performance", ICLR'22): the share of
predictions whose top score exceeds the threshold at which that share matched the
accuracy on the held-out set.

None of them can see an error the primary model makes with full confidence on inputs that
look familiar (a new defect type it calls clean): the drift detector
(:mod:`fedge.monitoring.drift`) is the complement.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from fedge.monitoring.features import IMAGE_STATS, SCORE_FEATURES, score_features

FEATURES: tuple[str, ...] = SCORE_FEATURES + IMAGE_STATS
"""The columns of :func:`feature_row`, in order (``top`` first)."""

FORMAT = "fedge.mpp.logistic"
FORMAT_VERSION = 1
MIN_FIT_ROWS = 10
L2_PENALTY = 1.0  # on standardised coefficients, as scikit-learn's C = 1 per fitted row set
_TOP_CLIP = 1e-6  # -log(1 - top) is capped at ~13.8 for a top score of 1.0
_NEWTON_STEPS = 100


def feature_row(scores: Mapping[str, float], stats: Mapping[str, float]) -> list[float]:
    """The MPP features of one prediction: score features, then image statistics.

    ``scores`` maps class -> probability; ``stats`` is :func:`~fedge.monitoring.features.
    image_stats`'s output (extra keys are ignored). Missing statistics or non-finite values
    raise ``ValueError``.
    """
    if not scores:
        raise ValueError("feature_row needs at least one score")
    missing = [name for name in IMAGE_STATS if name not in stats]
    if missing:
        raise ValueError(f"image statistics are missing {missing} (have {sorted(stats)})")
    values = [*score_features(scores).values(), *(float(stats[name]) for name in IMAGE_STATS)]
    if not all(math.isfinite(v) for v in values):
        raise ValueError(
            f"feature_row got a NaN or infinite value: scores {dict(scores)}, stats {dict(stats)}"
        )
    return values


def calibration_estimate(scores: Sequence[Mapping[str, float]]) -> float:
    """Mean top score over a window: the confidence baseline (Hendrycks & Gimpel, ICLR'17)."""
    if not scores:
        raise ValueError("calibration_estimate needs at least one score vector")
    tops = [score_features(one)["top"] for one in scores]
    if not all(math.isfinite(t) for t in tops):
        raise ValueError("calibration_estimate got a NaN or infinite score")
    return float(np.mean(tops))


class MppPredictor:
    """Predicts P(primary model correct | :func:`feature_row`); averages it into accuracy."""

    def __init__(
        self,
        *,
        mean: Sequence[float],
        scale: Sequence[float],
        coef: Sequence[float],
        intercept: float,
        atc_threshold: float,
        n_fit: int,
        fit_accuracy: float,
    ) -> None:
        width = len(DESIGN)
        if not (len(mean) == len(scale) == len(coef) == width):
            raise ValueError(
                f"MPP model needs {width} means, scales and coefficients, got "
                f"{len(mean)}, {len(scale)}, {len(coef)}"
            )
        numbers = [*mean, *scale, *coef, intercept, atc_threshold, fit_accuracy]
        if not all(
            not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
            for v in numbers
        ):
            raise ValueError("MPP model parameters must be finite numbers")
        if any(s <= 0 for s in scale):
            raise ValueError("MPP model scales must be positive")
        self.mean = np.asarray(mean, dtype=np.float64)
        self.scale = np.asarray(scale, dtype=np.float64)
        self.coef = np.asarray(coef, dtype=np.float64)
        self.intercept = float(intercept)
        self.atc_threshold = float(atc_threshold)
        self.n_fit = int(n_fit)
        self.fit_accuracy = float(fit_accuracy)

    @classmethod
    def fit(
        cls, rows: Sequence[Sequence[float]], correct: Sequence[bool], seed: int = 0
    ) -> MppPredictor:
        """Fit on held-out rows and whether the primary model was right on each.

        Deterministic (Newton's method has no randomness; ``seed`` is accepted so a
        randomised learner could replace it without changing callers). When every row is
        correct (or every row wrong) there is nothing to separate: the model becomes the
        constant Jeffreys-smoothed rate ``(k + 0.5) / (n + 1)``.
        """
        del seed
        x = _rows("fit", rows)
        y = np.asarray([bool(c) for c in correct], dtype=np.float64)
        if y.size != x.shape[0]:
            raise ValueError(f"fit got {x.shape[0]} rows but {y.size} correctness labels")
        if x.shape[0] < MIN_FIT_ROWS:
            raise ValueError(f"fit needs at least {MIN_FIT_ROWS} rows, got {x.shape[0]}")
        design = _design(x)
        mean = design.mean(axis=0)
        scale = design.std(axis=0)
        scale[scale < 1e-12] = 1.0  # a constant column carries nothing; keep it harmless
        z = (design - mean) / scale
        k, n = float(y.sum()), float(y.size)
        if k in (0.0, n):
            coef = np.zeros(design.shape[1])
            rate = (k + 0.5) / (n + 1.0)
            intercept = math.log(rate / (1.0 - rate))
        else:
            coef, intercept = _fit_logistic(z, y)
        return cls(
            mean=mean.tolist(),
            scale=scale.tolist(),
            coef=coef.tolist(),
            intercept=intercept,
            atc_threshold=_atc_threshold(x[:, 0], y),
            n_fit=int(n),
            fit_accuracy=k / n,
        )

    def predict_proba(self, rows: Sequence[Sequence[float]]) -> npt.NDArray[np.float64]:
        """P(correct) for each row."""
        z = (_design(_rows("estimate", rows)) - self.mean) / self.scale
        return _sigmoid(z @ self.coef + self.intercept)

    def estimate(self, rows: Sequence[Sequence[float]]) -> float:
        """Estimated accuracy over a window: the mean of :meth:`predict_proba`."""
        return float(self.predict_proba(rows).mean())

    def estimate_atc(self, rows: Sequence[Sequence[float]]) -> float:
        """Average thresholded confidence (Garg et al., ICLR'22) over a window."""
        tops = _rows("estimate", rows)[:, 0]
        return float(np.mean(tops > self.atc_threshold))

    def to_json(self) -> str:
        """Plain JSON (floats round-trip exactly); :meth:`from_json` reads it back."""
        return json.dumps(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "features": list(FEATURES),
                "design": list(DESIGN),
                "mean": self.mean.tolist(),
                "scale": self.scale.tolist(),
                "coef": self.coef.tolist(),
                "intercept": self.intercept,
                "atc_threshold": self.atc_threshold,
                "n_fit": self.n_fit,
                "fit_accuracy": self.fit_accuracy,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> MppPredictor:
        """Read :meth:`to_json`'s output; anything else raises ``ValueError``.

        The text comes from the store, which other processes and people can write: every
        failure, whatever raised it, is a ``ValueError`` naming what is wrong, so the
        caller can refit instead of losing the model's monitoring.
        """
        try:
            return cls._from_json(text)
        except ValueError:
            raise
        except Exception as exc:  # untrusted input: any failure is bad input
            raise ValueError(f"MPP model JSON is unusable: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def _from_json(cls, text: str) -> MppPredictor:
        try:
            data: Any = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"MPP model is not JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not an MPP model (expected format {FORMAT!r})")
        if data.get("version") != FORMAT_VERSION or isinstance(data.get("version"), bool):
            raise ValueError(
                f"MPP model version {data.get('version')!r} is not {FORMAT_VERSION}: refit it"
            )
        if data.get("features") != list(FEATURES) or data.get("design") != list(DESIGN):
            raise ValueError(
                f"MPP model was fitted on features {data.get('features')!r}, this fedge "
                f"computes {list(FEATURES)}: refit it"
            )
        missing = [k for k in _FIELDS if k not in data]
        if missing:
            raise ValueError(f"MPP model JSON lacks or mistypes a field: missing {missing}")
        n_fit = data["n_fit"]
        if type(n_fit) is not int or not MIN_FIT_ROWS <= n_fit <= MAX_FIT_ROWS:
            raise ValueError(
                f"MPP model n_fit must be a whole number in [{MIN_FIT_ROWS}, {MAX_FIT_ROWS}], "
                f"got {n_fit!r}"
            )
        accuracy = _number(data["fit_accuracy"], "fit_accuracy")
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"MPP model fit_accuracy must be in [0, 1], got {accuracy!r}")
        return cls(
            mean=_numbers(data["mean"], "mean"),
            scale=_numbers(data["scale"], "scale"),
            coef=_numbers(data["coef"], "coef"),
            intercept=_number(data["intercept"], "intercept"),
            atc_threshold=_number(data["atc_threshold"], "atc_threshold"),
            n_fit=n_fit,
            fit_accuracy=accuracy,
        )


_FIELDS = ("mean", "scale", "coef", "intercept", "atc_threshold", "n_fit", "fit_accuracy")
MAX_FIT_ROWS = 100_000_000  # far above any held-out set; more means the text is corrupt


def _number(value: object, name: str) -> float:
    # bool is an int in Python; true/false in the JSON is a corrupt model, not 1 or 0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"MPP model {name} must be a number, got {value!r:.40}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"MPP model {name} must be finite, got {number!r}")
    return number


def _numbers(value: object, name: str) -> list[float]:
    if not isinstance(value, list):
        raise ValueError(f"MPP model {name} must be a list of numbers, got {value!r:.40}")
    return [_number(v, name) for v in value]


DESIGN: tuple[str, ...] = (*FEATURES, "neg_log_1m_top")
"""The logistic regression's inputs: the features plus ``-log(1 - top)``."""


def _design(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    top = np.clip(x[:, 0], 0.0, 1.0 - _TOP_CLIP)
    return np.column_stack([x, -np.log1p(-top)])


def _rows(what: str, rows: Sequence[Sequence[float]]) -> npt.NDArray[np.float64]:
    if len(rows) == 0:
        raise ValueError(f"{what} needs at least one feature row")
    try:
        x = np.asarray(rows, dtype=np.float64)
    except (TypeError, ValueError) as exc:  # ragged rows, or values that are not numbers
        raise ValueError(
            f"{what}: feature rows must be {len(FEATURES)} numbers each ({exc})"
        ) from exc
    if x.ndim != 2 or x.shape[1] != len(FEATURES):
        raise ValueError(
            f"{what}: feature rows must have {len(FEATURES)} values ({', '.join(FEATURES)}); "
            f"got shape {x.shape} (build them with feature_row)"
        )
    bad = int(np.count_nonzero(~np.isfinite(x).all(axis=1)))
    if bad:
        raise ValueError(f"{what}: {bad} feature row(s) hold NaN or infinite values")
    return x


def _sigmoid(z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    result: npt.NDArray[np.float64] = 0.5 * (1.0 + np.tanh(0.5 * z))  # stable for any z
    return result


def _fit_logistic(
    z: npt.NDArray[np.float64], y: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], float]:
    """Newton's method on the mean log-loss + L2 / (2 n) on the weights, not the intercept."""
    n, d = z.shape
    a = np.column_stack([np.ones(n), z])
    penalty = np.full(d + 1, L2_PENALTY / n)
    penalty[0] = 0.0  # an unpenalised intercept keeps the fit calibrated in the large
    w = np.zeros(d + 1)
    for _ in range(_NEWTON_STEPS):
        p = _sigmoid(a @ w)
        gradient = a.T @ (p - y) / n + penalty * w
        hessian = (a.T * (p * (1.0 - p))) @ a / n + np.diag(penalty) + 1e-12 * np.eye(d + 1)
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if float(np.max(np.abs(step))) < 1e-10:
            break
    return w[1:], float(w[0])


def _atc_threshold(tops: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> float:
    """The top score ``t`` with share(top > t) equal to the held-out accuracy (Garg et al.)."""
    accuracy = float(y.mean())
    ordered = np.sort(tops)
    # The (1 - accuracy) quantile, taken at an observed value so ties stay on one side.
    index = min(max(math.floor((1.0 - accuracy) * ordered.size) - 1, -1), ordered.size - 1)
    return float(ordered[index]) if index >= 0 else float(ordered[0]) - 1e-12

"""A newly activated model's probation: window statistics in, a verdict out (pure).

After a deployment activates, the agent keeps its previous verified model and watches
the new one over a probation window (issue "The closed loop": local rollback on the
edge, after AWS IoT Greengrass's roll back on a failed health check). The window ends
after ``images`` inference attempts or ``seconds``, whichever comes first. The checks,
in this order; the first that fails decides and names the measured value and the limit:

1. ``inference_errors``: the share of images the model failed to score is over
   ``max_error_rate``. Decided as soon as the errors alone put the full window over the
   limit: a model that fails every image goes at once, not after a whole window.
   (Undecodable files are not the model's fault and are not counted.)
2. ``non_finite_scores``: any NaN or infinite score. Records clamp scores to [0, 1],
   which would hide a NaN; one is enough, and it is decided at once.
3. ``latency``: the p95 of the per-image inference latency over the window is over the
   manifest's ``latency_budget_ms`` (no budget, no check).
4. ``scores_collapsed``: the defect score (the highest positive class's, the score the
   decision thresholds) hardly varies over the window -- its standard deviation is below
   ``min_spread`` -- while the previous model's, over its last window on the same
   station, did vary (at least ``min_spread``). A model that gives every image the same
   score decides nothing; comparing with the previous model keeps a confident model on
   a line of identical good parts from being taken for a broken one. With no baseline
   (the previous model scored too few images since the agent started) this check does
   not fail a model.

A window that ends by time with fewer than ``min_images`` attempts passes: there is too
little evidence to take a model away (the verdict says so).

A model that kills the agent (an inference that segfaults or runs out of memory) never
fills a window: every start resumes the trial from zero. :func:`restarted` fails a trial
the agent was started with more than ``max_restarts`` times without a verdict.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from fedge.protocols.errors import ValidationError


@dataclass(frozen=True)
class ProbationPolicy:
    images: int = 50
    seconds: float = 600.0
    min_images: int = 10
    max_error_rate: float = 0.05
    min_spread: float = 0.001
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if self.images < 1:
            raise ValidationError(f"probation_images must be >= 1, got {self.images}")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValidationError(f"probation_s must be > 0, got {self.seconds}")
        if not 1 <= self.min_images <= self.images:
            raise ValidationError(
                f"probation_min_images must be in [1, probation_images={self.images}], "
                f"got {self.min_images}"
            )
        if not 0.0 <= self.max_error_rate < 1.0:
            raise ValidationError(
                f"probation_max_error_rate must be in [0, 1), got {self.max_error_rate}"
            )
        if not (math.isfinite(self.min_spread) and self.min_spread >= 0):
            raise ValidationError(f"probation_min_spread must be >= 0, got {self.min_spread}")
        if self.max_restarts < 0:
            raise ValidationError(f"probation_max_restarts must be >= 0, got {self.max_restarts}")


@dataclass(frozen=True)
class Window:
    """What the model did since it was activated."""

    attempts: int = 0
    errors: int = 0
    non_finite: int = 0
    latencies_ms: tuple[float, ...] = ()
    defect_scores: tuple[float, ...] = ()


def observe(
    window: Window,
    *,
    latencies_ms: Sequence[float] = (),
    defect_scores: Sequence[float] = (),
    non_finite: int = 0,
    errors: int = 0,
) -> Window:
    """``window`` with one batch added: its scored images, and the images that failed."""
    return replace(
        window,
        attempts=window.attempts + len(latencies_ms) + errors,
        errors=window.errors + errors,
        non_finite=window.non_finite + non_finite,
        latencies_ms=window.latencies_ms + tuple(latencies_ms),
        defect_scores=window.defect_scores + tuple(defect_scores),
    )


def defect_indices(classes: Sequence[str], positive_classes: Sequence[str]) -> tuple[int, ...]:
    """The score columns of the defect classes (every class but the first when none is
    declared, as :func:`fedge.edge_agent.config.decisions.decide` reads them)."""
    positives = set(positive_classes) or set(classes[1:])
    return tuple(i for i, name in enumerate(classes) if name in positives)


def defect_scores(rows: np.ndarray, indices: Sequence[int]) -> tuple[list[float], int]:
    """Each finite row's defect score, and how many rows had a NaN or infinite score.

    Plain Python over the rows: a call sees one image's row or a batch's few (a handful
    of classes each), where NumPy's per-call cost was most of the time (issue 25).
    """
    if rows.size == 0:
        return [], 0
    scores: list[float] = []
    non_finite = 0
    for row in rows.tolist():
        if not all(math.isfinite(value) for value in row):
            non_finite += 1
        else:
            scores.append(max((row[i] for i in indices), default=0.0))
    return scores, non_finite


def spread(values: Sequence[float]) -> float:
    """Population standard deviation (0 for fewer than two values)."""
    return float(np.std(values)) if len(values) >= 2 else 0.0


def p95(values: Sequence[float]) -> float:
    """The 95th percentile, nearest rank (a value that was measured)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class Outcome(StrEnum):
    PENDING = "pending"
    PASSED = "passed"
    FAILED = "failed"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    check: str = ""
    measured: float = 0.0
    limit: float = 0.0
    images: int = 0
    note: str = ""

    @property
    def reason(self) -> str:
        """One line for the manager: which check, the measured value and the limit."""
        if self.outcome is not Outcome.FAILED:
            return self.note
        if self.check == "restarts":  # judged on the agent's starts, not on images
            return f"{self.check}: {self.note}"
        return f"{self.check}: {self.note} over {self.images} image(s)"


def restarted(policy: ProbationPolicy, starts: int) -> Verdict | None:
    """The verdict on a trial the agent was started with ``starts`` times (None: go on)."""
    if starts <= policy.max_restarts:
        return None
    return Verdict(
        Outcome.FAILED,
        "restarts",
        float(starts),
        float(policy.max_restarts),
        0,
        f"the agent restarted {starts} times while this model was on probation "
        f"(limit {policy.max_restarts})",
    )


def judge(
    policy: ProbationPolicy,
    window: Window,
    elapsed_s: float,
    latency_budget_ms: float | None,
    baseline_spread: float | None,
) -> Verdict:
    """The verdict on a model after ``elapsed_s`` of probation (see the module doc)."""
    n = window.attempts
    allowed_errors = math.floor(policy.max_error_rate * policy.images)
    if window.errors > allowed_errors:
        rate = window.errors / n
        return Verdict(
            Outcome.FAILED,
            "inference_errors",
            rate,
            policy.max_error_rate,
            n,
            f"{window.errors} of {n} image(s) failed to score "
            f"(rate {rate:.3f} > limit {policy.max_error_rate:g})",
        )
    if window.non_finite > 0:
        return Verdict(
            Outcome.FAILED,
            "non_finite_scores",
            float(window.non_finite),
            0.0,
            n,
            f"{window.non_finite} image(s) got NaN or infinite scores (limit 0)",
        )
    if n < policy.images and elapsed_s < policy.seconds:
        return Verdict(Outcome.PENDING, images=n, note=f"{n} of {policy.images} image(s)")
    if n < policy.min_images:
        return Verdict(
            Outcome.PASSED,
            images=n,
            note=f"probation ended after {elapsed_s:.0f} s with only {n} image(s) "
            f"(< {policy.min_images}): too few to judge",
        )
    rate = window.errors / n
    if rate > policy.max_error_rate:
        return Verdict(
            Outcome.FAILED,
            "inference_errors",
            rate,
            policy.max_error_rate,
            n,
            f"{window.errors} of {n} image(s) failed to score "
            f"(rate {rate:.3f} > limit {policy.max_error_rate:g})",
        )
    if latency_budget_ms is not None and window.latencies_ms:
        measured = p95(window.latencies_ms)
        if measured > latency_budget_ms:
            return Verdict(
                Outcome.FAILED,
                "latency",
                measured,
                latency_budget_ms,
                n,
                f"p95 {measured:.3g} ms > budget {latency_budget_ms:g} ms",
            )
    observed = spread(window.defect_scores)
    if (
        len(window.defect_scores) >= 2
        and baseline_spread is not None
        and baseline_spread >= policy.min_spread
        and observed < policy.min_spread
    ):
        return Verdict(
            Outcome.FAILED,
            "scores_collapsed",
            observed,
            policy.min_spread,
            n,
            f"defect score std {observed:.3g} < floor {policy.min_spread:g} "
            f"(the previous model's: {baseline_spread:.3g})",
        )
    return Verdict(Outcome.PASSED, images=n, note=f"passed over {n} image(s)")

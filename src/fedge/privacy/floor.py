"""A station's privacy floor: the least privacy it trains with, whatever a job asks (issue 24).

The floor is the station's own: its operator writes it in ``agent.toml`` (``fedge edge
enroll`` writes the default one, :func:`default_floor`), and the agent copies it into the
station's privacy ledger at every start (:mod:`fedge.party.budget`), where the ClientApp
reads it before anything trains. Nothing from the manager reaches it: the manager's
signed lifetime budget (``fedge edge set-privacy``) sits beside it in the ledger and can
only make the bound smaller (the ledger bounds by the smaller of the two, at the smaller
delta); clearing the manager's budget leaves the floor.

What a floor refuses, before training (:func:`round_refusal`, :func:`plan_refusal`):

- a round without DP-SGD (``dp-mode`` ``none`` or ``central``: the server would see the
  station's raw update);
- a fixed noise multiplier, or the one planned for the job's epsilon, below
  ``min_noise_multiplier``;
- a job target epsilon above ``job_epsilon``. A job that fixes only its noise is bounded
  at ``job_epsilon`` by the station (:func:`effective_spec`);
- a round that would take the lifetime spend past ``lifetime_epsilon`` (the ledger's
  check, in the same transaction as the reservation).

A job's delta above the floor's is not refused: the station plans and accounts the job at
the floor's smaller delta (more noise for the same epsilon), and says so in its reply.

Under a floor, evaluation of server-chosen weights on the station's held-out images is a
release too (:class:`EvaluationBudget`): at most ``evaluations_per_job`` per job, each
reporting the count of correct answers plus Gaussian noise of standard deviation
``evaluation_noise`` (sensitivity 1: one image changes the count by at most one), accounted
in the same ledger as a Gaussian mechanism (an Opacus release at sample rate 1, one step).

Stdlib only: the inference-only agent writes the floor without torch or Opacus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from fedge.privacy.settings import DpRelease, PrivacyError, PrivacyMode, PrivacySpec

DEFAULT_JOB_EPSILON = 8.0
"""The TiFL study's per-party epsilon (Chai et al. 2020, section 5)."""
DEFAULT_LIFETIME_EPSILON = 16.0
DEFAULT_MIN_NOISE_MULTIPLIER = 0.5
"""Below 0.5 DP-SGD's per-step cost grows so fast that a few epochs spend any budget."""
DEFAULT_EVALUATIONS_PER_JOB = 16
DEFAULT_EVALUATION_NOISE = 20.0
"""Standard deviation, in images, of the noise on an evaluation's correct count: 16
evaluations at delta 2e-5 cost about epsilon 1 (RDP); on 1,000 held-out images the
accuracy is off by 2% (one standard deviation)."""
DELTA_SHARE = 10
"""The floor's delta is at most 1 / (DELTA_SHARE x the images the station keeps)."""
NO_FLOOR = "none"
"""agent.toml's ``privacy_floor = "none"``: the station's operator opted out."""


class PrivacyFloorError(PrivacyError):
    """A round asked for less privacy than the station's floor: refused before training.

    The message names the floor and the setting that fell short."""


@dataclass(frozen=True)
class PrivacyFloor:
    """The least privacy a station trains and evaluates with; construction validates."""

    job_epsilon: float = DEFAULT_JOB_EPSILON
    """The largest epsilon one job may spend on this station (at ``delta``)."""
    lifetime_epsilon: float = DEFAULT_LIFETIME_EPSILON
    """The most the station spends over every job (at ``delta``)."""
    delta: float = 1.0 / (DELTA_SHARE * 5000)
    min_noise_multiplier: float = DEFAULT_MIN_NOISE_MULTIPLIER
    evaluations_per_job: int = DEFAULT_EVALUATIONS_PER_JOB
    evaluation_noise: float = DEFAULT_EVALUATION_NOISE
    mode: PrivacyMode = PrivacyMode.LOCAL
    """The least protective mode accepted: only ``local`` (DP-SGD on the station) is a
    floor; ``central`` trusts the server with the raw update, ``none`` is no floor."""

    def __post_init__(self) -> None:
        if self.mode is not PrivacyMode.LOCAL:
            raise PrivacyError(
                f"privacy_floor.mode must be 'local' (DP-SGD on the station), got "
                f"{getattr(self.mode, 'value', self.mode)!r}; a station that accepts rounds "
                'without DP-SGD opts out of the floor instead (privacy_floor = "none")'
            )
        for name in ("job_epsilon", "lifetime_epsilon", "min_noise_multiplier"):
            value = getattr(self, name)
            if not _positive(value):
                raise PrivacyError(f"privacy_floor.{name} must be a number > 0, got {value!r}")
        if self.job_epsilon > self.lifetime_epsilon:
            raise PrivacyError(
                f"privacy_floor.job_epsilon ({self.job_epsilon:g}) is above its "
                f"lifetime_epsilon ({self.lifetime_epsilon:g}): lower it"
            )
        if not (_positive(self.delta) and self.delta < 1):
            raise PrivacyError(f"privacy_floor.delta must be in (0, 1), got {self.delta!r}")
        evaluations = self.evaluations_per_job
        if isinstance(evaluations, bool) or not isinstance(evaluations, int) or evaluations < 0:
            raise PrivacyError(
                f"privacy_floor.evaluations_per_job must be a whole number >= 0, got "
                f"{evaluations!r}"
            )
        if not _positive(self.evaluation_noise):
            raise PrivacyError(
                f"privacy_floor.evaluation_noise must be > 0, got {self.evaluation_noise!r}"
            )

    def describe(self) -> str:
        """One line for errors and status: what the floor demands."""
        return (
            f"the station's privacy floor (DP-SGD, epsilon <= {self.job_epsilon:g} per job "
            f"and {self.lifetime_epsilon:g} over its lifetime at delta {self.delta:.3g}, "
            f"noise multiplier >= {self.min_noise_multiplier:g})"
        )

    def to_table(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "job_epsilon": self.job_epsilon,
            "lifetime_epsilon": self.lifetime_epsilon,
            "delta": self.delta,
            "min_noise_multiplier": self.min_noise_multiplier,
            "evaluations_per_job": self.evaluations_per_job,
            "evaluation_noise": self.evaluation_noise,
        }

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> PrivacyFloor:
        """agent.toml's ``[privacy_floor]`` table; unknown keys refused."""
        known = set(cls().to_table())
        unknown = sorted(set(table) - known)
        if unknown:
            raise PrivacyError(
                f"unknown setting privacy_floor.{unknown[0]} (known: {', '.join(sorted(known))})"
            )
        mode = table.get("mode", PrivacyMode.LOCAL.value)
        if mode not in {m.value for m in PrivacyMode}:
            raise PrivacyError(f"privacy_floor.mode must be 'local', got {mode!r}")
        values = {k: v for k, v in table.items() if k != "mode"}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise PrivacyError(f"privacy_floor.{name} must be a number, got {value!r}")
        return cls(mode=PrivacyMode(str(mode)), **values)


def default_floor(keep_images: int) -> PrivacyFloor:
    """What ``fedge edge enroll`` writes: delta at most 1 / (10 x keep_images), rounded
    down to one significant digit so agent.toml reads plainly."""
    images = max(int(keep_images), 1)
    return PrivacyFloor(delta=_round_down(1.0 / (DELTA_SHARE * images)))


def floor_toml(floor: PrivacyFloor | None) -> list[str]:
    """agent.toml's lines for ``floor``: an inline table, so keys appended after it stay
    top-level settings."""
    if floor is None:
        return [
            "# No privacy floor: this station's operator opted out (rounds without DP-SGD",
            "# are accepted). Remove this line for the default floor.",
            f'privacy_floor = "{NO_FLOOR}"',
        ]
    fields_ = ", ".join(
        f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value!r}"
        for key, value in floor.to_table().items()
    )
    return [
        "# The station's own privacy floor: the manager may tighten it, never loosen it.",
        f"privacy_floor = {{ {fields_} }}",
    ]


def effective_spec(floor: PrivacyFloor | None, spec: PrivacySpec) -> PrivacySpec:
    """The job's DP-SGD settings as this station plans and accounts them: the job's
    epsilon (or the floor's, when the job fixes only its noise) at the smaller delta."""
    if floor is None or spec.mode is not PrivacyMode.LOCAL:
        return spec
    epsilon = floor.job_epsilon if spec.epsilon is None else min(spec.epsilon, floor.job_epsilon)
    return replace(spec, epsilon=epsilon, delta=min(spec.delta, floor.delta))


def round_refusal(floor: PrivacyFloor | None, spec: PrivacySpec) -> str | None:
    """Why ``spec`` asks for less privacy than ``floor`` (None: it does not).

    Only what the round's config says; the noise a target epsilon plans to is checked by
    :func:`plan_refusal`, the lifetime by the ledger."""
    if floor is None:
        return None
    if spec.mode is not PrivacyMode.LOCAL:
        return (
            f"this round asks for dp-mode {spec.mode.value!r}, below {floor.describe()}: "
            'run the job with [privacy] mode = "local"'
        )
    sigma = spec.noise_multiplier
    if sigma is not None and sigma < floor.min_noise_multiplier:
        return (
            f"this round fixes noise multiplier {sigma:g}, below {floor.describe()}: raise "
            "privacy.noise_multiplier, or set privacy.epsilon instead"
        )
    if spec.epsilon is not None and spec.epsilon > floor.job_epsilon:
        return (
            f"this job asks for epsilon {spec.epsilon:g}, above {floor.describe()}: "
            f"run it with privacy.epsilon <= {floor.job_epsilon:g}"
        )
    return None


def plan_refusal(floor: PrivacyFloor | None, release: DpRelease) -> str | None:
    """Why the planned round's noise is below ``floor`` (None: it is not)."""
    if floor is None or release.noise_multiplier >= floor.min_noise_multiplier:
        return None
    return (
        f"the job's epsilon over its planned rounds needs noise multiplier "
        f"{release.noise_multiplier:.3g}, below {floor.describe()}: lower privacy.epsilon's "
        "demand (fewer rounds_per_party or local_epochs, a larger batch) or raise the noise"
    )


def lifetime_refusal(floor: PrivacyFloor | None, spent_after: float) -> str | None:
    """Why a round that would make the lifetime spend ``spent_after`` (at the floor's delta)
    goes past ``floor`` (None: it does not)."""
    if floor is None or spent_after <= floor.lifetime_epsilon * (1 + 1e-6):
        return None
    return (
        f"this round would make the station's lifetime epsilon {spent_after:.4g}, above "
        f"{floor.describe()}"
    )


@dataclass(frozen=True)
class EvaluationBudget:
    """Evaluations of server-chosen weights one station allows per job, and their noise."""

    per_job: int
    noise: float

    @classmethod
    def of(cls, floor: PrivacyFloor) -> EvaluationBudget:
        return cls(floor.evaluations_per_job, floor.evaluation_noise)

    def release(self) -> DpRelease:
        """One evaluation as the ledger accounts it: the Gaussian mechanism on a count of
        sensitivity 1 is DP-SGD's release at sample rate 1, one step, sigma = noise."""
        return DpRelease(noise_multiplier=self.noise, sample_rate=1.0, steps=1)

    def refusal(self, done_in_job: int, job: str) -> str | None:
        """Why one more evaluation in ``job`` is refused (None: it is allowed)."""
        if done_in_job < self.per_job:
            return None
        return (
            f"this station has answered {done_in_job} evaluation(s) in job {job!r}, the "
            f"most its privacy floor allows per job (privacy_floor.evaluations_per_job = "
            f"{self.per_job}); each one tells the server about its held-out images"
        )


def noisy_accuracy(correct: int, examples: int, noise_draw: float) -> float:
    """The accuracy reported: ``(correct + noise) / examples``, clipped to [0, 1]
    (post-processing: the clip costs no privacy). ``noise_draw`` is the Gaussian sample."""
    if examples <= 0:
        raise PrivacyError("an evaluation needs at least one held-out image")
    return min(1.0, max(0.0, (correct + noise_draw) / examples))


def _positive(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _round_down(value: float) -> float:
    """``value`` rounded down to one significant digit (2.4e-05 -> 2e-05)."""
    exponent = math.floor(math.log10(value))
    digit = math.floor(value / 10**exponent + 1e-9)  # 2e-05 / 1e-05 is 1.999... in floats
    return float(f"{digit}e{exponent}")

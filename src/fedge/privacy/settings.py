"""What a job asks for privacy, validated before any training (no torch, no Opacus here).

Three mechanisms, chosen per job (``[privacy]`` in a scenario or a job manifest):

- ``local``: DP-SGD on every party (Abadi et al., CCS 2016): per-sample gradients clipped
  to ``clipping_norm``, Gaussian noise of ``noise_multiplier * clipping_norm`` added to
  each batch's sum, the privacy cost accounted by an RDP (Mironov 2017) or PRV (Gopi et
  al. 2021) accountant through Opacus. A job gives a target ``epsilon`` per party for the
  whole job and the party derives its noise from its own data size, batch size and the
  job's planned participation (``rounds_per_party``), or the job fixes ``noise_multiplier``
  and the party only accounts for it. The TiFL study ran its parties at eps = 8,
  delta = 1e-3, sigma = 1.0 and stopped training at the bound
  (../shared/research/, Chai et al. 2020, section 5).
- ``central``: the server clips each party's update to ``clipping_norm`` and adds
  Gaussian noise to the mean (McMahan et al., ICLR 2018, "Learning differentially private
  recurrent language models"; Flower's ``DifferentialPrivacyServerSideFixedClipping``):
  station-level privacy, accounted per round.
- ``secagg``: Flower's SecAgg+ (Bell et al., CCS 2020) on top of either: the server only
  ever sees the sum of the round's masked updates. A sum of two hides nothing from
  either party (each subtracts its own), so a round has at least
  :data:`SECAGG_MIN_PARTIES` parties and a reconstruction threshold of at least as many
  (issue 24).

A :class:`PrivacySpec` travels to parties in the round's config (:meth:`to_config`,
:meth:`from_config`): every key starts with ``dp-`` so it never collides with training
keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from fedge.errors import FedgeError

SECAGG_MIN_PARTIES = 3
"""The fewest parties a SecAgg+ round asks, tiers under it hold, the reconstruction
threshold counts and the unmasked sum holds: with two, each learns the other's update."""


class PrivacyError(FedgeError):
    """A privacy setting or budget forbids what was asked: the message names the setting
    and the bound (the base of :mod:`fedge.privacy`'s errors)."""


class BudgetExhaustedError(PrivacyError):
    """Training this round would spend more epsilon than the party may spend.

    Raised by the party *before* training; Flower turns it into an error reply, and the
    strategy stops asking that party (``is_budget_exhausted`` on the reply's reason).
    """


BUDGET_EXHAUSTED = "BudgetExhaustedError"
"""What an error reply's reason contains when a party refused for its budget."""


class PrivacyMode(StrEnum):
    NONE = "none"
    LOCAL = "local"  # DP-SGD on each party (Opacus)
    CENTRAL = "central"  # server-side clipping and noise on the aggregate (Flower)


Accountant = Literal["rdp", "prv"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "prv")


@dataclass(frozen=True)
class PrivacySpec:
    """A job's privacy settings; construction validates every field."""

    mode: PrivacyMode = PrivacyMode.NONE
    epsilon: float | None = None
    """Local: each party's target for the whole job. Central: the job's bound."""
    delta: float = 1e-3
    clipping_norm: float = 1.0
    """Local: per-sample gradient norm. Central: per-party update norm."""
    noise_multiplier: float | None = None
    """Fixed sigma; ``None`` derives it from ``epsilon`` (local) or requires it (central)."""
    accountant: Accountant = "rdp"
    rounds_per_party: int | None = None
    """Local: rounds each party is planned to train in the job (the noise is planned for
    them; a party asked more often refuses once its target is spent). ``None``: our
    strategies send every round of the job (the conservative plan); a party that still
    gets none plans for one round (its budget holds; the job learns little)."""
    secagg: bool = False
    secagg_threshold: float = 0.5
    """SecAgg+'s reconstruction threshold: a share of the round's parties in (0, 1] (a
    share resolving to fewer than 3 parties is raised to 3), or an absolute count >= 3.
    Fewer surviving parties and the round's aggregate is lost."""
    secagg_clipping_range: float = 8.0
    """SecAgg+ clips every model value to [-range, range] before quantising it."""
    secagg_quantization_range: int = 4_194_304

    def __post_init__(self) -> None:
        if not isinstance(self.mode, PrivacyMode):
            raise PrivacyError(
                f"privacy.mode must be one of {[m.value for m in PrivacyMode]}, got {self.mode!r}"
            )
        if self.epsilon is not None and not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise PrivacyError(f"privacy.epsilon must be > 0, got {self.epsilon}")
        if not (math.isfinite(self.delta) and 0 < self.delta < 1):
            raise PrivacyError(f"privacy.delta must be in (0, 1), got {self.delta}")
        if not (math.isfinite(self.clipping_norm) and self.clipping_norm > 0):
            raise PrivacyError(f"privacy.clipping_norm must be > 0, got {self.clipping_norm}")
        sigma = self.noise_multiplier
        if sigma is not None and not (math.isfinite(sigma) and sigma > 0):
            raise PrivacyError(f"privacy.noise_multiplier must be > 0, got {sigma}")
        if self.accountant not in ACCOUNTANTS:
            raise PrivacyError(
                f"privacy.accountant must be one of {list(ACCOUNTANTS)}, got {self.accountant!r}"
            )
        if self.rounds_per_party is not None and self.rounds_per_party < 1:
            raise PrivacyError(
                f"privacy.rounds_per_party must be >= 1, got {self.rounds_per_party}"
            )
        if self.mode is PrivacyMode.LOCAL and self.epsilon is None and sigma is None:
            raise PrivacyError(
                "privacy.mode = 'local' needs a target privacy.epsilon (the party derives "
                "its noise) or a fixed privacy.noise_multiplier"
            )
        if self.mode is PrivacyMode.CENTRAL and sigma is None:
            raise PrivacyError("privacy.mode = 'central' needs privacy.noise_multiplier")
        threshold = self.secagg_threshold
        if not math.isfinite(threshold) or threshold <= 0 or 1 < threshold < SECAGG_MIN_PARTIES:
            raise PrivacyError(
                "privacy.secagg_threshold must be a share in (0, 1] or a count >= "
                f"{SECAGG_MIN_PARTIES} (fewer parties could unmask one another), got {threshold}"
            )
        if threshold > 1 and threshold != int(threshold):
            raise PrivacyError(
                f"privacy.secagg_threshold as a count must be whole, got {threshold}"
            )
        if not (math.isfinite(self.secagg_clipping_range) and self.secagg_clipping_range > 0):
            raise PrivacyError(
                f"privacy.secagg_clipping_range must be > 0, got {self.secagg_clipping_range}"
            )
        if self.secagg_quantization_range < 2:
            raise PrivacyError(
                "privacy.secagg_quantization_range must be >= 2, "
                f"got {self.secagg_quantization_range}"
            )

    @property
    def enabled(self) -> bool:
        return self.mode is not PrivacyMode.NONE or self.secagg

    def check_parties(self, per_round: int) -> None:
        """SecAgg+ needs at least three parties per round (with two, each learns the
        other's update from the sum) and a threshold they can meet."""
        if not self.secagg:
            return
        if per_round < SECAGG_MIN_PARTIES:
            raise PrivacyError(
                f"SecAgg+ needs at least {SECAGG_MIN_PARTIES} parties per round (with two, "
                f"each learns the other's update from their sum), got {per_round}"
            )
        if self.secagg_threshold > 1 and self.secagg_threshold > per_round:
            raise PrivacyError(
                f"privacy.secagg_threshold ({int(self.secagg_threshold)}) is more than the "
                f"{per_round} parties a round asks: no round could ever be unmasked"
            )

    # -- on the wire: the round's ConfigRecord

    def to_config(self) -> dict[str, str | float | int | bool]:
        """The keys a party reads (``from_config``); only what the party needs."""
        config: dict[str, str | float | int | bool] = {
            "dp-mode": self.mode.value,
            "dp-delta": self.delta,
            "dp-clipping-norm": self.clipping_norm,
            "dp-accountant": self.accountant,
        }
        if self.epsilon is not None:
            config["dp-epsilon"] = self.epsilon
        if self.noise_multiplier is not None:
            config["dp-noise-multiplier"] = self.noise_multiplier
        if self.rounds_per_party is not None:
            config["dp-rounds-per-party"] = self.rounds_per_party
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> PrivacySpec:
        """The spec a round's config carries (``mode = none`` when it carries none)."""
        mode = config.get("dp-mode", PrivacyMode.NONE.value)
        if mode not in {m.value for m in PrivacyMode}:
            raise PrivacyError(f"config['dp-mode'] must be one of none/local/central, got {mode!r}")
        accountant = config.get("dp-accountant", "rdp")
        if accountant not in ACCOUNTANTS:
            raise PrivacyError(f"config['dp-accountant'] must be rdp or prv, got {accountant!r}")
        return cls(
            mode=PrivacyMode(str(mode)),
            epsilon=_optional_number(config, "dp-epsilon"),
            delta=_number(config, "dp-delta", 1e-3),
            clipping_norm=_number(config, "dp-clipping-norm", 1.0),
            noise_multiplier=_optional_number(config, "dp-noise-multiplier"),
            accountant="prv" if accountant == "prv" else "rdp",
            rounds_per_party=_optional_int(config, "dp-rounds-per-party"),
        )

    @classmethod
    def from_table(cls, table: Mapping[str, object]) -> PrivacySpec:
        """A ``[privacy]`` TOML table (scenario or job manifest); unknown keys refused."""
        unknown = sorted(set(table) - _TABLE_FIELDS)
        if unknown:
            raise PrivacyError(
                f"unknown field 'privacy.{unknown[0]}' (known: {', '.join(sorted(_TABLE_FIELDS))})"
            )
        mode = table.get("mode", PrivacyMode.NONE.value)
        if mode not in {m.value for m in PrivacyMode}:
            raise PrivacyError(f"privacy.mode must be none, local or central, got {mode!r}")
        accountant = table.get("accountant", "rdp")
        if accountant not in ACCOUNTANTS:
            raise PrivacyError(f"privacy.accountant must be rdp or prv, got {accountant!r}")
        secagg = table.get("secagg", False)
        if not isinstance(secagg, bool):
            raise PrivacyError(f"privacy.secagg must be true or false, got {secagg!r}")
        _no_idle_fields(table, PrivacyMode(str(mode)), secagg)
        quantization = table.get("secagg_quantization_range", 4_194_304)
        if isinstance(quantization, bool) or not isinstance(quantization, int):
            raise PrivacyError(
                f"privacy.secagg_quantization_range must be a whole number, got {quantization!r}"
            )
        return cls(
            mode=PrivacyMode(str(mode)),
            epsilon=_optional_number(table, "epsilon", prefix="privacy."),
            delta=_number(table, "delta", 1e-3, prefix="privacy."),
            clipping_norm=_number(table, "clipping_norm", 1.0, prefix="privacy."),
            noise_multiplier=_optional_number(table, "noise_multiplier", prefix="privacy."),
            accountant="prv" if accountant == "prv" else "rdp",
            rounds_per_party=_optional_int(table, "rounds_per_party", prefix="privacy."),
            secagg=secagg,
            secagg_threshold=_number(table, "secagg_threshold", 0.5, prefix="privacy."),
            secagg_clipping_range=_number(table, "secagg_clipping_range", 8.0, prefix="privacy."),
            secagg_quantization_range=quantization,
        )


_TABLE_FIELDS = frozenset(
    (
        "mode",
        "epsilon",
        "delta",
        "clipping_norm",
        "noise_multiplier",
        "accountant",
        "rounds_per_party",
        "secagg",
        "secagg_threshold",
        "secagg_clipping_range",
        "secagg_quantization_range",
    )
)


@dataclass(frozen=True)
class DpRelease:
    """One round's accounted DP-SGD: an Opacus accountant history entry (sigma, q, steps)."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        sigma = self.noise_multiplier
        if not (math.isfinite(sigma) and sigma > 0):
            raise PrivacyError(f"a DP release's noise multiplier must be > 0, got {sigma}")
        if not (math.isfinite(self.sample_rate) and 0 < self.sample_rate <= 1):
            raise PrivacyError(
                f"a DP release's sample rate must be in (0, 1], got {self.sample_rate}"
            )
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise PrivacyError(f"a DP release's steps must be an integer >= 0, got {self.steps!r}")


_DP_FIELDS = ("epsilon", "delta", "clipping_norm", "noise_multiplier", "accountant")
_SECAGG_FIELDS = ("secagg_threshold", "secagg_clipping_range", "secagg_quantization_range")


def _no_idle_fields(table: Mapping[str, object], mode: PrivacyMode, secagg: bool) -> None:
    """A setting the chosen mode ignores is an error: ``epsilon = 8`` without ``mode =
    "local"`` would otherwise train with no privacy at all, silently."""
    idle: list[tuple[str, str]] = []
    if mode is PrivacyMode.NONE:
        fix = 'mode = "none" adds no noise: set mode = "local" (DP-SGD) or "central"'
        idle += [(f, fix) for f in (*_DP_FIELDS, "rounds_per_party")]
    if mode is PrivacyMode.CENTRAL:
        idle += [("rounds_per_party", "central DP accounts every round of the job")]
    if not secagg:
        idle += [(f, "secagg is off: set secagg = true") for f in _SECAGG_FIELDS]
    for name, why in idle:
        if name in table:
            raise PrivacyError(f"privacy.{name} has no effect ({why}, or remove it)")


def is_budget_exhausted(reason: str) -> bool:
    """Whether an error reply's reason says the party refused for its privacy budget."""
    return BUDGET_EXHAUSTED in reason


def _number(
    table: Mapping[str, object], key: str, default: float, *, prefix: str = "config:"
) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PrivacyError(f"{prefix}{key} must be a number, got {value!r}")
    return float(value)


def _optional_number(
    table: Mapping[str, object], key: str, *, prefix: str = "config:"
) -> float | None:
    if table.get(key) is None:
        return None
    return _number(table, key, 0.0, prefix=prefix)


def _optional_int(table: Mapping[str, object], key: str, *, prefix: str = "config:") -> int | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise PrivacyError(f"{prefix}{key} must be an integer, got {value!r}")
    return value

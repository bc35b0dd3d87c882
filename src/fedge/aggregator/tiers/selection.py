"""TiFL's tier selection (Algorithm 2, ChangeProbs, Eq. 5) as pure functions over frozen
dataclasses.

Chai et al., "TiFL: A Tier-based Federated Learning System", HPDC'20. The tiers themselves
are formed in :mod:`fedge.aggregator.tiers.groups`; the strategy owns the state and calls, per
round ``r``::

    state = maybe_update_probabilities(state, r, interval)   # Algorithm 2, before choosing
    tier, state = choose_tier(state, rng)
    ...train the tier's parties, then for every tier whose accuracy was measured:
    state = record_tier_accuracy(state, t, accuracy_of_t, r)

Deliberate divergences from the paper:

* **Accuracy per tier from the tier's own reports.** The paper evaluates the global model on
  every tier's test data every round (``A^r_t``). We use whatever the strategy records --
  typically the example-weighted mean accuracy reported by the tier's parties -- and read
  ``A^r_t`` as "the latest accuracy recorded for t at a round <= r". A tier never measured
  counts as the least accurate (``-inf``): it gets the highest probability, which also
  makes sure every tier is eventually measured.
* **The normaliser.** The paper prints ``D = n(n-1)/2``, which does not sum to 1; we use
  ``D = n(n+1)/2`` as fltk and FLGo do (research notes, section 1.1).
* **Exhausted credits.** Resampling until a tier with credit comes up (the paper's loop) is
  the same distribution as sampling once from the probabilities renormalised over the tiers
  with credit, which cannot loop forever. If every tier with credit has probability 0 (a
  static policy with zeros), we fall back to uniform over the tiers with credit.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np


def adaptive_probabilities(
    accuracies: Sequence[float], credits: Sequence[int | None]
) -> tuple[float, ...]:
    """TiFL's ChangeProbs (Algorithm 2) with the corrected normaliser ``D = n(n+1)/2``.

    The ``n`` tiers with credit left (``None`` = unlimited) are sorted by accuracy,
    ascending; the i-th (0-based) gets ``(n - i) / D``, so the least accurate tier is the
    most likely. Tiers without credit get 0. Equal accuracies favour the faster tier
    (lower index), the cheaper one to run.
    """
    if len(accuracies) != len(credits):
        raise ValueError(f"{len(accuracies)} accuracies but {len(credits)} credits")
    for tier, accuracy in enumerate(accuracies):
        if math.isnan(accuracy):
            raise ValueError(f"accuracy of tier {tier} is NaN")
    eligible = [tier for tier, credit in enumerate(credits) if _has_credit(credit)]
    if not eligible:
        raise ValueError("no tier has credit left: the run has used its selection budget")
    ranked = sorted(eligible, key=lambda tier: (accuracies[tier], tier))
    n = len(ranked)
    normaliser = n * (n + 1) / 2
    probabilities = [0.0] * len(credits)
    for i, tier in enumerate(ranked):
        probabilities[tier] = (n - i) / normaliser
    return tuple(probabilities)


@dataclass(frozen=True)
class TierSelectionState:
    """Everything Algorithm 2 carries from round to round.

    ``accuracy_history[t]`` holds the accuracies recorded for tier ``t``, oldest first, and
    ``accuracy_rounds[t]`` the rounds they were recorded at (non-decreasing). ``credits[t]``
    is how many more times tier ``t`` may be chosen (``None`` = unlimited). A static state
    (``adaptive=False``) never changes its probabilities.
    """

    probabilities: tuple[float, ...]
    credits: tuple[int | None, ...]
    accuracy_history: tuple[tuple[float, ...], ...]
    accuracy_rounds: tuple[tuple[int, ...], ...]
    current_tier: int | None = None  # the tier chosen last
    last_change_round: int | None = None  # the round the probabilities last changed
    adaptive: bool = True

    def __post_init__(self) -> None:
        n = len(self.probabilities)
        if n < 1:
            raise ValueError("a selection state needs at least one tier")
        lengths = {len(self.credits), len(self.accuracy_history), len(self.accuracy_rounds)}
        if lengths != {n}:
            raise ValueError(
                f"{n} probabilities but {len(self.credits)} credits, "
                f"{len(self.accuracy_history)} histories, {len(self.accuracy_rounds)} round lists"
            )
        _check_probabilities(self.probabilities)
        for tier, credit in enumerate(self.credits):
            if credit is not None and credit < 0:
                raise ValueError(f"credits of tier {tier} must be >= 0, got {credit}")
        for tier, (values, rounds) in enumerate(
            zip(self.accuracy_history, self.accuracy_rounds, strict=True)
        ):
            if len(values) != len(rounds):
                raise ValueError(f"tier {tier}: {len(values)} accuracies, {len(rounds)} rounds")
        if self.current_tier is not None and not 0 <= self.current_tier < n:
            raise ValueError(f"current_tier must be in [0, {n}), got {self.current_tier}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TierSelectionState":
        """Inverse of ``dataclasses.asdict`` after a JSON round trip (lists -> tuples)."""
        current, changed = data.get("current_tier"), data.get("last_change_round")
        return cls(
            probabilities=tuple(float(p) for p in data["probabilities"]),
            credits=tuple(None if c is None else int(c) for c in data["credits"]),
            accuracy_history=tuple(
                tuple(float(a) for a in tier) for tier in data["accuracy_history"]
            ),
            accuracy_rounds=tuple(tuple(int(r) for r in tier) for tier in data["accuracy_rounds"]),
            current_tier=None if current is None else int(current),
            last_change_round=None if changed is None else int(changed),
            adaptive=bool(data.get("adaptive", True)),
        )

    @property
    def n_tiers(self) -> int:
        return len(self.probabilities)

    def accuracy_at(self, tier: int, server_round: int) -> float | None:
        """``A^r_t``: the latest accuracy recorded for ``tier`` at a round <= ``server_round``."""
        found: float | None = None
        for value, at in zip(self.accuracy_history[tier], self.accuracy_rounds[tier], strict=True):
            if at > server_round:
                break
            found = value
        return found


def default_credits(total_rounds: int, n_tiers: int) -> int:
    """Credits per tier so that the tiers together cover the run: ``ceil(R/T)`` (fltk)."""
    if total_rounds < 1 or n_tiers < 1:
        raise ValueError(f"need total_rounds >= 1 and n_tiers >= 1, got {total_rounds}, {n_tiers}")
    return math.ceil(total_rounds / n_tiers)


def initial_state(
    n_tiers: int,
    credits_per_tier: int | Sequence[int | None] | None = None,
    static_probabilities: Sequence[float] | None = None,
) -> TierSelectionState:
    """The state before round 1: uniform ``1/T`` probabilities (adaptive), or fixed ones.

    ``credits_per_tier``: one number for every tier, one per tier, or ``None`` for
    unlimited (the usual choice for static selection; :func:`default_credits` gives TiFL's
    adaptive budget). With ``static_probabilities`` the state is static: the probabilities
    (e.g. TiFL's ``uniform`` 0.2 x 5 or ``fast`` 1,0,0,0,0) never change.
    """
    if n_tiers < 1:
        raise ValueError(f"n_tiers must be >= 1, got {n_tiers}")
    credits: tuple[int | None, ...]
    if credits_per_tier is None or isinstance(credits_per_tier, int):
        credits = (credits_per_tier,) * n_tiers
    else:
        credits = tuple(credits_per_tier)
        if len(credits) != n_tiers:
            raise ValueError(f"{len(credits)} credits for {n_tiers} tiers")
    if static_probabilities is None:
        probabilities = (1 / n_tiers,) * n_tiers
    else:
        if len(static_probabilities) != n_tiers:
            raise ValueError(f"{len(static_probabilities)} probabilities for {n_tiers} tiers")
        _check_probabilities(static_probabilities)
        total = math.fsum(static_probabilities)
        probabilities = tuple(p / total for p in static_probabilities)
    return TierSelectionState(
        probabilities=probabilities,
        credits=credits,
        accuracy_history=((),) * n_tiers,
        accuracy_rounds=((),) * n_tiers,
        adaptive=static_probabilities is None,
    )


def record_tier_accuracy(
    state: TierSelectionState, tier: int, accuracy: float, server_round: int
) -> TierSelectionState:
    """Append ``A^r_t``. A second record for the same round replaces the first.

    Aggregate a tier's reports first (e.g. mean accuracy weighted by examples) and record
    the tier once per round.
    """
    if not 0 <= tier < state.n_tiers:
        raise ValueError(f"tier must be in [0, {state.n_tiers}), got {tier}")
    if not math.isfinite(accuracy):
        raise ValueError(f"accuracy of tier {tier} must be finite, got {accuracy}")
    values, rounds = state.accuracy_history[tier], state.accuracy_rounds[tier]
    if rounds and server_round < rounds[-1]:
        raise ValueError(
            f"tier {tier}: round {server_round} recorded after round {rounds[-1]}; "
            "record accuracies in round order"
        )
    if rounds and server_round == rounds[-1]:
        values, rounds = values[:-1], rounds[:-1]
    history = list(state.accuracy_history)
    history[tier] = (*values, accuracy)
    at = list(state.accuracy_rounds)
    at[tier] = (*rounds, server_round)
    return replace(state, accuracy_history=tuple(history), accuracy_rounds=tuple(at))


def maybe_update_probabilities(
    state: TierSelectionState, server_round: int, interval: int
) -> TierSelectionState:
    """Algorithm 2's check for round ``r``; call it once per round.

    Either at the start of round ``r`` before :func:`choose_tier` (the paper's order), or
    after recording round ``r``'s accuracies (then ``A^r`` includes them); ``current_tier``
    is the tier chosen last either way.

    When ``r % I == 0 and r >= I`` and the current tier did not improve over the last ``I``
    rounds (``A^r <= A^{r-I}``), the probabilities become
    ``adaptive_probabilities(A^r_1..A^r_T, credits)``. ``A^{r-I}`` falls back to the tier's
    earliest record when it was first measured after ``r - I``; with no record at all, or
    no tier chosen yet, nothing changes. Static states never change.
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    tier = state.current_tier
    if not state.adaptive or tier is None or server_round < interval:
        return state
    if server_round % interval != 0:
        return state
    now = state.accuracy_at(tier, server_round)
    if now is None:
        return state
    before = state.accuracy_at(tier, server_round - interval)
    if before is None:
        before = state.accuracy_history[tier][0]
    if now > before:
        return state
    if not any(_has_credit(c) for c in state.credits):
        return state  # nothing to choose from; choose_tier reports it
    accuracies = [state.accuracy_at(t, server_round) for t in range(state.n_tiers)]
    probabilities = adaptive_probabilities(
        [-math.inf if a is None else a for a in accuracies], state.credits
    )
    return replace(state, probabilities=probabilities, last_change_round=server_round)


def choose_tier(
    state: TierSelectionState, rng: np.random.Generator
) -> tuple[int, TierSelectionState]:
    """Draw this round's tier and spend one of its credits.

    Samples from the probabilities renormalised over tiers with credit (equivalent to the
    paper's resample-until-credit loop); uniform over them if all their probabilities are 0.
    """
    eligible = [_has_credit(c) for c in state.credits]
    if not any(eligible):
        raise ValueError(
            "every tier has spent its credits; raise credits_per_tier "
            "(default_credits(total_rounds, n_tiers) covers the run)"
        )
    weights = np.array(
        [p if ok else 0.0 for p, ok in zip(state.probabilities, eligible, strict=True)]
    )
    if weights.sum() <= 0:
        weights = np.array(eligible, dtype=float)
    tier = int(rng.choice(len(weights), p=weights / weights.sum()))
    credits = list(state.credits)
    spent = credits[tier]
    credits[tier] = None if spent is None else spent - 1
    return tier, replace(state, credits=tuple(credits), current_tier=tier)


def estimated_training_time(
    rounds: int, tier_latency_max: Sequence[float], probabilities: Sequence[float]
) -> float:
    """TiFL Eq. 5: ``L_all = R * sum_i max(L_tier_i) * P_i`` (MAPE <= 5% in the paper)."""
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if len(tier_latency_max) != len(probabilities):
        raise ValueError(
            f"{len(tier_latency_max)} tier latencies but {len(probabilities)} probabilities"
        )
    return rounds * math.fsum(
        latency * p for latency, p in zip(tier_latency_max, probabilities, strict=True)
    )


def _has_credit(credit: int | None) -> bool:
    return credit is None or credit > 0


def _check_probabilities(probabilities: Sequence[float]) -> None:
    for tier, p in enumerate(probabilities):
        if not (math.isfinite(p) and p >= 0):
            raise ValueError(f"probability of tier {tier} must be >= 0, got {p}")
    total = math.fsum(probabilities)
    if abs(total - 1) > 1e-6:
        raise ValueError(f"tier probabilities must sum to 1, got {total}")

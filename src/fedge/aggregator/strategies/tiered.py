"""TiFL: tier-based federated learning (Chai et al., HPDC'20), as a Flower strategy.

1. Profiling: the first ``profiling_rounds`` rounds ask every party and wait at most
   ``profiling_deadline_s``; a party that misses it is charged that time (TiFL's T_max).
   Every later reply updates its party's latency online (EWMA).
2. Tiering: parties sorted by latency and cut into ``n_tiers`` equal-count tiers, fastest
   first; parties slower than ``dropout_threshold_s`` are left out. Tiers are re-formed
   every ``retier_interval`` rounds from the online profiles.
3. Selection: each round one tier is drawn -- from fixed probabilities (static TiFL) or
   adaptively (Algorithm 2): every ``interval`` rounds, if the tier in use stopped
   improving, the tiers are re-weighted by accuracy, lowest accuracy highest, with the
   corrected normaliser n(n+1)/2; a tier's credits cap how often it can be drawn.
   ``per_round`` parties are then drawn inside the tier.

Per-tier accuracy: TiFL evaluates the global model on every tier's data each round. We
use what the tier's parties already report: ``local-acc``, the accuracy of the model they
received on their local validation split, measured before training. A tier's accuracy is
thus refreshed whenever it is selected (no extra evaluation round, no extra time).

Deadlines (:class:`DeadlineConfig`) combine with tiers: the deadline is derived from the
selected tier's p90 latency.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.aggregator.tiers import groups as tiers
from fedge.aggregator.tiers import selection as tier_selection

LOCAL_ACCURACY_KEY = "local-acc"


class TieredFedAvg(StreamingFedAvg):
    def __init__(
        self,
        *,
        n_tiers: int = 5,
        profiling_rounds: int = 1,
        profiling_deadline_s: float | None = None,
        adaptive: bool = True,
        interval: int = 10,
        credits_per_tier: int | Sequence[int] | None = None,
        static_probabilities: Sequence[float] | None = None,
        retier_interval: int | None = None,
        dropout_threshold_s: float | None = None,
        min_tier_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if n_tiers < 1:
            raise ValueError(f"n_tiers must be >= 1, got {n_tiers}")
        if profiling_rounds < 1:
            raise ValueError(f"profiling_rounds must be >= 1, got {profiling_rounds}")
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if static_probabilities is not None and len(static_probabilities) != n_tiers:
            raise ValueError("static_probabilities needs one probability per tier")
        self.n_tiers = n_tiers
        self.profiling_rounds = profiling_rounds
        self.profiling_deadline_s = profiling_deadline_s
        self.adaptive = adaptive
        self.interval = interval
        self.credits_per_tier = credits_per_tier
        self.static_probabilities = tuple(static_probabilities) if static_probabilities else None
        self.retier_interval = retier_interval
        self.dropout_threshold_s = dropout_threshold_s
        # Under SecAgg+ at least 3 (``run_secagg`` raises it): a pair learns each other's.
        self.min_tier_size = min_tier_size
        self.tiers: tiers.Tiers | None = None
        self.selection: tier_selection.TierSelectionState | None = None
        self._profiling_plan: deadlines.RoundPlan | None = None

    # -- selection

    def plan(self, server_round: int, grid: Grid) -> tuple[deadlines.RoundPlan, int | None]:
        if server_round <= self.profiling_rounds:
            everyone = tuple(self.trainable(grid))
            return deadlines.RoundPlan(everyone, len(everyone), self.profiling_deadline_s), None
        if (
            self.tiers is None
            or (
                self.retier_interval
                and (server_round - self.profiling_rounds) % self.retier_interval == 0
            )
            or self._holds_exhausted()
        ):
            self._form_tiers()
        return super().plan(server_round, grid)

    def _holds_exhausted(self) -> bool:
        """Whether a party out of privacy budget is still in a tier (it refused since the
        tiers were formed): a tier of such parties would keep its odds and credits and be
        drawn for nothing. Tiers are formed without them, so this is "exhausted grew"."""
        if self.tiers is None or not self.exhausted:
            return False
        return any(n in self.exhausted for members in self.tiers.members for n in members)

    def candidates(
        self, server_round: int, node_ids: Sequence[int]
    ) -> tuple[Sequence[int], int | None]:
        assert self.tiers is not None and self.selection is not None
        tier, self.selection = tier_selection.choose_tier(self.selection, self.rng)
        live = set(node_ids)
        members = [n for n in self.tiers.members[tier] if n in live]
        # A tier whose parties all left the grid: fall back to everyone this round.
        return (members, tier) if members else (node_ids, None)

    def expected_latency(self, server_round: int, tier: int | None) -> float | None:
        if tier is None or self.tiers is None:
            return super().expected_latency(server_round, tier)
        return self.tiers.latency_p90(tier, self._latencies())

    def _latencies(self) -> dict[int, float]:
        return {node: profile.mean_s for node, profile in self.profiles.items()}

    def final_tiers(self) -> tiers.Tiers | None:
        """The tiers the next round would use: formed from the profiles when the job
        ended before tiering (as many rounds as profiling ones), else the current ones."""
        if self.tiers is None and self.profiles:
            self._form_tiers()
        return self.tiers

    def _form_tiers(self) -> None:
        # Only parties that may still train are tiered (TiFL re-tiers from the profiles;
        # a party out of privacy budget will never reply again).
        latencies = {n: s for n, s in self._latencies().items() if n not in self.exhausted}
        if not latencies and self.tiers is not None:
            return  # nobody left to tier: the loop stops on its own (no trainable party)
        n_tiers = min(self.n_tiers, max(1, len(latencies)))
        self.tiers = tiers.form_tiers(
            latencies,
            n_tiers,
            dropout_threshold_s=self.dropout_threshold_s,
            min_size=self.min_tier_size,
        )
        # A re-tiering that changes the number of tiers (dropouts) starts selection afresh.
        if self.selection is None or self.selection.n_tiers != self.tiers.n_tiers:
            credits = self.credits_per_tier
            static = self.static_probabilities
            if static is not None and len(static) != self.tiers.n_tiers:
                static = None
            self.selection = tier_selection.initial_state(
                self.tiers.n_tiers,
                credits if credits is None or isinstance(credits, int) else tuple(credits),
                static_probabilities=static
                if static and len(static) == self.tiers.n_tiers
                else None,
            )

    # -- adaptation

    def after_round(self, record: RoundRecord, replies: dict[int, Message]) -> None:
        if record.tier is None or self.selection is None:
            return
        accuracy = _mean_local_accuracy(list(replies.values()))
        if accuracy is not None:
            self.selection = tier_selection.record_tier_accuracy(
                self.selection, record.tier, accuracy, record.server_round
            )
        if self.adaptive:
            self.selection = tier_selection.maybe_update_probabilities(
                self.selection, record.server_round, self.interval
            )

    # -- checkpoints

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["tiers"] = None if self.tiers is None else dataclasses.asdict(self.tiers)
        state["selection"] = None if self.selection is None else dataclasses.asdict(self.selection)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.tiers = None if state["tiers"] is None else tiers.Tiers.from_dict(state["tiers"])
        self.selection = (
            None
            if state["selection"] is None
            else tier_selection.TierSelectionState.from_dict(state["selection"])
        )


def _mean_local_accuracy(replies: list[Message]) -> float | None:
    values = []
    for reply in replies:
        for record in reply.content.metric_records.values():
            value = record.get(LOCAL_ACCURACY_KEY)
            if isinstance(value, int | float) and math.isfinite(value):
                values.append(float(value))
    return sum(values) / len(values) if values else None

"""What a strategy built on ``StreamingFedAvg`` may change, with plain FedAvg's answers.

:class:`~fedge.aggregator.strategies.streaming.StreamingFedAvg` runs the round (plan, send, collect,
settle, fold, close); it asks these hooks at each step, and the strategies on top
override them instead of the loop:

- :meth:`RoundHooks.candidates`, :meth:`RoundHooks.expected_latency`: who is asked and
  how long to wait (TiFL's tiers, :mod:`fedge.aggregator.strategies.tiered`);
- :meth:`RoundHooks.round_config`: extra config for the round's parties;
- :meth:`RoundHooks.fold_group`, :meth:`RoundHooks.aggregate`: which running mean a reply
  is folded into and how the folds become the new model (FedDF's one model per
  architecture, :mod:`fedge.aggregator.strategies.feddf`);
- :meth:`RoundHooks.after_round`: what to learn from a settled round (TiFL's tier
  accuracies);
- :meth:`RoundHooks.extra_arrays`, :meth:`RoundHooks.restore_extra_arrays`: models a
  checkpoint keeps besides the global one.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message

from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.rounds import latency
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.rounds.replies import serialise


class RoundHooks:
    """The defaults: uniform sampling, a p90 deadline, one model, nothing extra to keep."""

    profiles: dict[int, latency.LatencyProfile]  # the parties' latencies, kept by the loop

    def candidates(
        self, server_round: int, node_ids: Sequence[int]
    ) -> tuple[Sequence[int], int | None]:
        """Who may be selected this round, and the tier they form (None = no tiers)."""
        return node_ids, None

    def expected_latency(self, server_round: int, tier: int | None) -> float | None:
        """The latency a deadline is derived from (None = no deadline this round)."""
        known = [p.mean_s for p in self.profiles.values()]
        return float(np.percentile(known, 90)) if known else None

    def round_config(self, server_round: int, plan: deadlines.RoundPlan) -> dict[str, Any]:
        """Extra config sent to the parties of this round."""
        return {}

    def after_round(self, record: RoundRecord, replies: dict[int, Message]) -> None:
        """Called once a round is settled (TiFL updates tier accuracies here)."""

    def fold_group(self, node: int) -> str:
        """Which running mean ``node``'s reply this round is folded into.

        FedAvg has one (``""``); a strategy that trains several models at once (one per
        architecture, :mod:`fedge.aggregator.strategies.feddf`) names one group per model. Called
        when
        the round's messages exist, so it may depend on what was sent to ``node``.
        """
        return ""

    def aggregate(
        self,
        server_round: int,
        arrays: ArrayRecord,
        folds: dict[str, StreamingMean],
        metrics: dict[str, float],
    ) -> ArrayRecord:
        """The round's new global model from its folds (``arrays``: what was sent).

        ``metrics`` are the round's training metrics; an override may add its own.
        """
        unexpected = sorted(set(folds) - {""})
        if unexpected:  # fold_group() was overridden without aggregate(): replies would vanish
            raise ValueError(f"{type(self).__name__} cannot aggregate fold groups {unexpected}")
        fold = folds.get("")
        return serialise(fold) if fold is not None and fold.count else arrays

    def extra_arrays(self) -> dict[str, dict[str, np.ndarray]]:
        """Models a checkpoint must keep besides the global one (name -> arrays)."""
        return {}

    def restore_extra_arrays(self, arrays: dict[str, dict[str, np.ndarray]]) -> None:
        """Take back what :meth:`extra_arrays` gave to a checkpoint."""
        if arrays:
            raise ValueError(f"{type(self).__name__} keeps no extra models, got {sorted(arrays)}")

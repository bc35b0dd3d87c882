"""FedDF-style ensemble distillation across heterogeneous architectures, with TiFL tiers.

FedDF (Lin et al., NeurIPS 2020; ../shared/research/fl-algorithms.md section 5.1) fuses
models of different architectures by distilling their ensemble on unlabeled server-side
data. Here the architecture follows the device: a job gives each TIER an architecture
(``tier_archs``, fastest tier first), so slow parties train a small model and fast parties
a large one. The strategy keeps one global model per architecture. A round:

1. TiFL picks a tier (:class:`~fedge.aggregator.tiered.TieredFedAvg`); before tiers exist
   (the profiling rounds) every party gets the largest architecture. Each party receives
   its tier's model, and ``config["arch"]`` names that architecture.
2. The replies of each architecture are averaged, weighted by examples (one
   :class:`~fedge.aggregator.fold.StreamingMean` per architecture).
3. The teacher is the average logits of every architecture model trained so far; each
   architecture is distilled towards it on the proxy set
   (:func:`fedge.aggregator.ensemble.distill_into_each`). Labels are never used.

The "global" arrays the loop returns (what ``evaluate_fn`` and ``Result`` see) are the
largest architecture's model, :attr:`DistillingTieredFedAvg.evaluation_arch`. Server-side
distillation time is not charged to the virtual clock (the clock models the parties).

Virtual clock only: with the wall clock, streaming.py folds replies into a single
:class:`~fedge.aggregator.fold.StreamingMean` inside ``_collect_streaming``.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedge.aggregator import deadline as deadlines
from fedge.aggregator import ensemble
from fedge.aggregator.clock import ClockMode
from fedge.aggregator.fold import StreamingMean
from fedge.aggregator.rounds import RoundRecord
from fedge.aggregator.streaming import (
    _Late,
    _serialise,
    _weight,
    _weighted_metrics,
    arrays_of,
)
from fedge.aggregator.tiered import TieredFedAvg
from fedge.models import digits

DEFAULT_TIER_ARCHS = ("mlp-large", "mlp-large", "mlp", "mlp-small", "mlp-small")


class DistillingTieredFedAvg(TieredFedAvg):
    def __init__(
        self,
        *,
        proxy_X: np.ndarray,
        tier_archs: Sequence[str] = DEFAULT_TIER_ARCHS,
        temperature: float = 1.0,
        distill_epochs: int = 5,
        distill_lr: float = 1e-3,
        distill_batch_size: int = 32,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if self.clock is not ClockMode.VIRTUAL:
            raise ValueError(
                "distill runs on the virtual clock only (wall-clock rounds fold every "
                "reply into one model in StreamingFedAvg._collect_streaming)"
            )
        archs = tuple(tier_archs)
        if not archs:
            raise ValueError("tier_archs must name one architecture per tier, got none")
        if not all(isinstance(a, str) for a in archs):
            raise ValueError(f"tier_archs must be architecture names, got {list(archs)}")
        unknown = sorted(set(archs) - set(digits.ARCHITECTURES))
        if unknown:
            known = ", ".join(sorted(digits.ARCHITECTURES))
            raise ValueError(f"tier_archs: unknown architecture(s) {unknown} (known: {known})")
        if len(archs) != self.n_tiers:
            raise ValueError(
                f"tier_archs needs one architecture per tier: {self.n_tiers} tiers, "
                f"{len(archs)} architectures"
            )
        self.proxy_X = ensemble.validate_proxy(proxy_X)
        self.distill_settings = ensemble.DistillSettings(
            temperature=temperature,
            epochs=distill_epochs,
            lr=distill_lr,
            batch_size=distill_batch_size,
        )
        self.tier_archs = archs
        sizes = {a: digits.count_parameters(digits.make_model(a)) for a in set(archs)}
        self.evaluation_arch = max(archs, key=lambda a: sizes[a])
        """The largest architecture: the model returned as the global one."""
        self.models: dict[str, ArrayRecord] = {}
        self.trained: set[str] = set()  # architectures that received replies (teachers)
        self.distill_losses: dict[str, tuple[float, float]] = {}
        self._node_arch: dict[int, str] = {}
        self._sent_records: list[ArrayRecord] = []
        self._late_arch: list[tuple[str, _Late]] = []

    # -- who trains what

    def arch_of(self, node: int, server_round: int) -> str:
        """The architecture ``node`` trains in ``server_round`` (its tier's)."""
        if server_round <= self.profiling_rounds or self.tiers is None:
            return self.evaluation_arch
        tier = self.tiers.tier_of(node)
        if tier is None:
            # Dropouts are the slowest parties; anyone else unknown gets the largest.
            return self.tier_archs[-1] if node in self.tiers.dropouts else self.evaluation_arch
        # A re-tiering may form fewer tiers than configured: map proportionally.
        return self.tier_archs[tier * len(self.tier_archs) // self.tiers.n_tiers]

    def _ensure_models(self, arrays: ArrayRecord) -> None:
        if self.models:
            return
        probe = digits.make_model(self.evaluation_arch)
        try:
            digits.load_arrays(probe, arrays)
        except digits.ModelError as exc:
            raise digits.ModelError(
                f"distill: the initial arrays must be a {self.evaluation_arch!r} model "
                f"(the largest of tier_archs): {exc}"
            ) from None
        self.models[self.evaluation_arch] = arrays
        for index, arch in enumerate(sorted(set(self.tier_archs) - {self.evaluation_arch})):
            model = digits.make_model(arch, seed=self.seed + 1 + index)
            self.models[arch] = digits.to_arrays(model)

    def _messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        plan: deadlines.RoundPlan,
    ) -> list[Message]:
        self._ensure_models(arrays)
        base = ConfigRecord(dict(config))
        base["server-round"] = server_round
        for key, value in self.round_config(server_round, plan).items():
            base[key] = value
        contents: dict[str, RecordDict] = {}
        self._node_arch = {}
        messages = []
        for node in plan.selected:
            arch = self.arch_of(node, server_round)
            content = contents.get(arch)
            if content is None:
                round_config = ConfigRecord(dict(base))
                round_config["arch"] = arch
                content = RecordDict(
                    {self.arrayrecord_key: self.models[arch], self.configrecord_key: round_config}
                )
                contents[arch] = content
            self._node_arch[node] = arch
            messages.append(
                Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN)
            )
        self._sent_records = [self.models[arch] for arch in contents]
        self._sent = self.models[self.evaluation_arch]
        return messages

    def _arrays(self, message: Message) -> dict[str, np.ndarray]:
        record = message.content[self.arrayrecord_key]
        if isinstance(record, ArrayRecord) and any(record is r for r in self._sent_records):
            return arrays_of(record)  # an echo of a global model: never empty it
        return super()._arrays(message)

    # -- the round

    def run_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        timeout: float,
    ) -> tuple[ArrayRecord, RoundRecord]:
        plan, tier = self.plan(server_round, grid)
        messages = self._messages(server_round, arrays, config, plan)
        replies, arrivals, failures = self._collect_all(grid, messages, timeout)
        settlement = deadlines.settle(plan, arrivals)
        folds: dict[str, StreamingMean] = {}
        stale_folded = self._fold_late_by_arch(folds, server_round)
        for node in settlement.on_time:  # in virtual arrival order
            message = replies[node]
            arch = self._node_arch[node]
            folds.setdefault(arch, StreamingMean()).add(self._arrays(message), _weight(message))
        if self.deadline.late_policy == "stale":
            for node in settlement.late:
                message = replies[node]
                late = _Late(self._arrays(message), _weight(message), server_round)
                self._late_arch.append((self._node_arch[node], late))
        for arch, fold in folds.items():
            if fold.count and fold.total_weight > 0:
                self.models[arch] = _serialise(fold)
                self.trained.add(arch)
        metrics = _weighted_metrics([replies[n] for n in settlement.on_time if n in replies])
        if folds and self.trained:
            self.models, self.distill_losses = ensemble.distill_into_each(
                self.models,
                self.proxy_X,
                self.distill_settings,
                teachers=self.trained,
                seed=self.seed * 100_003 + server_round,
            )
            for arch, (before, after) in self.distill_losses.items():
                metrics[f"distill-kl-before/{arch}"] = before
                metrics[f"distill-kl-after/{arch}"] = after
        record = self.close_round(
            server_round, plan, tier, settlement, arrivals, replies, failures, stale_folded, metrics
        )
        return self.models[self.evaluation_arch], record

    def _fold_late_by_arch(self, folds: dict[str, StreamingMean], server_round: int) -> int:
        for arch, late in self._late_arch:
            weight = late.weight * deadlines.staleness_weight(
                server_round - late.origin_round, exponent=self.deadline.staleness_exponent
            )
            folds.setdefault(arch, StreamingMean()).add(late.arrays, weight)
        folded = len(self._late_arch)
        self._late_arch.clear()
        return folded

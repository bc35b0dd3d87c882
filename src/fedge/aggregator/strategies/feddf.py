"""FedDF-style ensemble distillation across heterogeneous architectures, with TiFL tiers.

FedDF (Lin et al., NeurIPS 2020; ../shared/research/fl-algorithms.md section 5.1) fuses
models of different architectures by distilling their ensemble on unlabeled server-side
data. Here the architecture follows the device: a job gives each TIER an architecture
(``tier_archs``, fastest tier first), so slow parties train a small model and fast parties
a large one. The strategy keeps one global model per architecture. Which architectures
exist is the caller's catalogue (:class:`~fedge.models.architectures.Architectures`): the
digits MLPs in the simulator, a registry model's family at several sizes on a fleet
(:mod:`fedge.aggregator.fleet.tier_models`), the same code either way. A round:

1. TiFL picks a tier (:class:`~fedge.aggregator.strategies.tiered.TieredFedAvg`); before tiers exist
   (the profiling rounds) every party gets the largest architecture. Each party receives
   its tier's model, and ``config["arch"]`` names that architecture.
2. The replies of each architecture are averaged, weighted by examples (one
   :class:`~fedge.aggregator.rounds.fold.StreamingMean` per architecture).
3. The teacher is the average logits of every architecture model trained so far; each
   architecture is distilled towards it on the proxy set
   (:func:`fedge.aggregator.strategies.ensemble.distill_into_each`). Labels are never used.

The "global" arrays the loop returns (what ``evaluate_fn`` and ``Result`` see) are the
largest architecture's model, :attr:`DistillingTieredFedAvg.evaluation_arch`. Server-side
distillation time is not charged to the virtual clock (the clock models the parties).

Both clocks: the round loop is :class:`~fedge.aggregator.strategies.streaming.StreamingFedAvg`'s,
which folds each reply into its architecture's running mean as it arrives
(:meth:`DistillingTieredFedAvg.fold_group`) and hands the folds to
:meth:`DistillingTieredFedAvg.aggregate`. Checkpoints keep every architecture's model.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.replies import arrays_of, serialise, to_array_record
from fedge.aggregator.strategies import ensemble
from fedge.aggregator.strategies.architectures import TieredArchitectures
from fedge.models import digits
from fedge.models.architectures import DIGITS, Architectures

DEFAULT_TIER_ARCHS = ("mlp-large", "mlp-large", "mlp", "mlp-small", "mlp-small")


class DistillingTieredFedAvg(TieredArchitectures):
    def __init__(
        self,
        *,
        proxy_X: np.ndarray,
        tier_archs: Sequence[str] = DEFAULT_TIER_ARCHS,
        temperature: float = 1.0,
        distill_epochs: int = 5,
        distill_lr: float = 1e-3,
        distill_batch_size: int = 32,
        distill_validation: float = 0.0,
        distill_patience: int = 5,
        architectures: Architectures = DIGITS,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("server_opt") is not None:
            # FedOpt steps one model along one pseudo-gradient; here each architecture's
            # model is re-made by ensemble distillation on the proxy set after its mean, so
            # there is no single "sent - mean" to step along (Lin et al. fuse, not average).
            raise ValueError(
                "server_opt: distill cannot take a server optimizer (its models come from "
                "ensemble distillation, not from one folded mean); use kind 'tiered' with "
                "server_opt, or distill without it"
            )
        super().__init__(tier_archs=tier_archs, architectures=architectures, **kwargs)
        self.proxy_X = ensemble.validate_proxy(proxy_X, architectures.sample_shape)
        self.distill_settings = ensemble.DistillSettings(
            temperature=temperature,
            epochs=distill_epochs,
            lr=distill_lr,
            batch_size=distill_batch_size,
            validation_fraction=distill_validation,
            patience=distill_patience,
        )
        # One split for the whole job (seeded like the tiers): every round early-stops on
        # the same held-out proxy samples.
        self.proxy_split = ensemble.split_proxy(
            len(self.proxy_X), distill_validation, self.seed * 7_919 + 1
        )
        self.models: dict[str, ArrayRecord] = {}
        self.trained: set[str] = set()  # architectures that received replies (teachers)
        self.distill_losses: dict[str, tuple[float, float]] = {}

    def _ensure_models(self, arrays: ArrayRecord) -> None:
        if self.models:
            return
        probe = self.architectures.build(self.evaluation_arch, 0)
        try:
            digits.load_arrays(probe, arrays)
        except digits.ModelError as exc:
            raise digits.ModelError(
                f"distill: the initial arrays must be a {self.evaluation_arch!r} model "
                f"(the largest of tier_archs): {exc}"
            ) from None
        self.models[self.evaluation_arch] = arrays
        for index, arch in enumerate(sorted(set(self.tier_archs) - {self.evaluation_arch})):
            model = self.architectures.build(arch, self.seed + 1 + index)
            self.models[arch] = digits.to_arrays(model)

    def _messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        plan: deadlines.RoundPlan,
    ) -> list[Message]:
        self._ensure_models(arrays)
        return super()._messages(server_round, arrays, config, plan)

    def model_for(self, arch: str, arrays: ArrayRecord) -> ArrayRecord:
        return self.models[arch]

    # -- the round (StreamingFedAvg's loop folds each reply into its architecture's mean)

    def aggregate(
        self,
        server_round: int,
        arrays: ArrayRecord,
        folds: dict[str, StreamingMean],
        metrics: dict[str, float],
    ) -> ArrayRecord:
        """Per-architecture averages, then the ensemble distilled into every architecture."""
        for arch, fold in folds.items():
            if fold.count and fold.total_weight > 0:
                self.models[arch] = serialise(fold)
                self.trained.add(arch)
        # distill_epochs = 0 (the ablation) transfers nothing: skip building the ensemble.
        if folds and self.trained and self.distill_settings.epochs:
            self.models, self.distill_losses = ensemble.distill_into_each(
                self.models,
                self.proxy_X,
                self.distill_settings,
                teachers=self.trained,
                seed=self.seed * 100_003 + server_round,
                architectures=self.architectures,
                split=self.proxy_split,
            )
            for arch, (before, after) in self.distill_losses.items():
                metrics[f"distill-kl-before/{arch}"] = before
                metrics[f"distill-kl-after/{arch}"] = after
        return self.models[self.evaluation_arch]

    # -- checkpoints: every architecture's model, and which have been trained

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "trained": sorted(self.trained)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trained = {str(arch) for arch in state["trained"]}
        if not trained <= set(self.tier_archs):
            raise ValueError(f"checkpoint trained {sorted(trained)}, not all in tier_archs")
        super().load_state_dict(state)
        self.trained = trained

    def extra_arrays(self) -> dict[str, dict[str, np.ndarray]]:
        return {arch: arrays_of(record) for arch, record in self.models.items()}

    def restore_extra_arrays(self, arrays: dict[str, dict[str, np.ndarray]]) -> None:
        """Every architecture's model, each checked against its architecture first."""
        if set(arrays) != set(self.tier_archs):
            raise ValueError(
                f"checkpoint holds models of {sorted(arrays)}, the strategy trains "
                f"{sorted(set(self.tier_archs))}"
            )
        models = {arch: to_array_record(values) for arch, values in arrays.items()}
        for arch, record in models.items():
            try:
                digits.load_arrays(self.architectures.build(arch, 0), record)
            except digits.ModelError as exc:
                raise ValueError(f"checkpoint's {arch} model: {exc}") from None
        self.models = models

    def _echoes(self) -> Sequence[ArrayRecord]:
        # A late in-process reply may echo a model sent in an earlier round: any global
        # model counts, not only this round's.
        return (*super()._echoes(), *self.models.values())

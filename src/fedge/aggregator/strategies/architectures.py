"""TiFL tiers that each train their own architecture: what FedDF and HeteroFL share.

A job gives each tier an architecture (``tier_archs``, fastest tier first), so slow
parties train a small model and fast parties a large one; the largest is the global
model the round loop returns and evaluates. Each round every party receives its tier's
model with ``config["arch"]`` naming the architecture, and its reply is folded into that
architecture's running mean (``fold_group``). How the architectures' models relate is
the subclass's: FedDF (:mod:`fedge.aggregator.strategies.feddf`) keeps one model per
architecture and fuses them by distillation; HeteroFL
(:mod:`fedge.aggregator.strategies.nested`) cuts every smaller one from the global model.
Which architectures exist is the caller's catalogue
(:class:`~fedge.models.architectures.Architectures`).
"""

from collections.abc import Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.strategies.tiered import TieredFedAvg
from fedge.aggregator.tiers.architectures import architecture_of
from fedge.models.architectures import DIGITS, Architectures


class TieredArchitectures(TieredFedAvg):
    """TiFL tiers, one architecture each (module docstring); subclasses say which model
    an architecture is sent (:meth:`model_for`) and how the folds become the new global
    model (``aggregate``)."""

    def __init__(
        self,
        *,
        tier_archs: Sequence[str],
        architectures: Architectures = DIGITS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        archs = tuple(tier_archs)
        if not archs:
            raise ValueError("tier_archs must name one architecture per tier, got none")
        if not all(isinstance(a, str) for a in archs):
            raise ValueError(f"tier_archs must be architecture names, got {list(archs)}")
        architectures.check(archs)
        if len(archs) != self.n_tiers:
            raise ValueError(
                f"tier_archs needs one architecture per tier: {self.n_tiers} tiers, "
                f"{len(archs)} architectures"
            )
        self.architectures = architectures
        self.tier_archs = archs
        sizes = {a: architectures.parameters(a) for a in set(archs)}
        self.evaluation_arch = max(archs, key=lambda a: sizes[a])
        """The largest architecture: the model returned as the global one."""
        self._node_arch: dict[int, str] = {}

    def arch_of(self, node: int, server_round: int) -> str:
        """The architecture ``node`` trains in ``server_round`` (its tier's); everyone's
        is the largest in TiFL's profiling rounds."""
        tiers = None if server_round <= self.profiling_rounds else self.tiers
        return architecture_of(node, tiers, self.tier_archs, self.evaluation_arch)

    def model_for(self, arch: str, arrays: ArrayRecord) -> ArrayRecord:
        """The model an ``arch`` party is sent this round, ``arrays`` being the global one."""
        raise NotImplementedError

    def _messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        plan: deadlines.RoundPlan,
    ) -> list[Message]:
        base = self._round_config_record(server_round, config, plan)
        contents: dict[str, RecordDict] = {}
        models: dict[str, ArrayRecord] = {}
        self._node_arch = {}
        messages = []
        for node in plan.selected:
            arch = self.arch_of(node, server_round)
            content = contents.get(arch)
            if content is None:
                round_config = ConfigRecord(dict(base))
                round_config["arch"] = arch
                model = models[arch] = self.model_for(arch, arrays)
                content = contents[arch] = RecordDict(
                    {self.arrayrecord_key: model, self.configrecord_key: round_config}
                )
            self._node_arch[node] = arch
            messages.append(
                Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN)
            )
        self._sent = tuple(models.values())
        return messages

    def fold_group(self, node: int) -> str:
        return self._node_arch[node]

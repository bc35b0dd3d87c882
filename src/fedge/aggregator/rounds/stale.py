"""Late replies held for a later round: staleness folding (FedBuff, Nguyen et al., AISTATS'22).

A party that misses its round's quorum or deadline is *late*. With ``late_policy =
"stale"`` its model is not thrown away: it is decoded, held, and folded into the next
round's running mean with its weight scaled by
:func:`~fedge.aggregator.rounds.deadline.staleness_weight` of how many rounds old it is. Both
loops hold late replies the same way: the wall-clock loop when a straggler's reply is
pulled in a later round, the settled loops (virtual clock, Flower's ``start``) when the
round's replies are settled.

Held replies are whole models, so checkpoints keep them as arrays beside the JSON state
(:func:`as_tuples`, :func:`from_tuples`).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, Message

from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.replies import decode_arrays, reply_weight

HeldTuple = tuple[dict[str, np.ndarray], float, int, str]
"""A held reply as a checkpoint stores it: (arrays, weight, origin round, group)."""


@dataclass
class LateReply:
    arrays: dict[str, np.ndarray]
    weight: float
    origin_round: int
    group: str = ""  # the fold it belongs to (see StreamingFedAvg.fold_group)


def hold(
    reply: Message, key: str, echoes: Sequence[ArrayRecord], origin_round: int, group: str
) -> LateReply:
    """Decode a late reply to round ``origin_round`` for folding in a later round."""
    return LateReply(decode_arrays(reply, key, echoes), reply_weight(reply), origin_round, group)


def fold_stale(
    held: Iterable[LateReply],
    folds: dict[str, StreamingMean],
    server_round: int,
    *,
    exponent: float,
) -> int:
    """Fold ``held`` into ``folds`` (by group) at their staleness weight; how many were folded."""
    folded = 0
    for late in held:
        staleness = server_round - late.origin_round
        weight = late.weight * deadlines.staleness_weight(staleness, exponent=exponent)
        folds.setdefault(late.group, StreamingMean()).add(late.arrays, weight)
        folded += 1
    return folded


def as_tuples(held: Iterable[LateReply]) -> list[HeldTuple]:
    return [(late.arrays, late.weight, late.origin_round, late.group) for late in held]


def from_tuples(held: Iterable[HeldTuple]) -> list[LateReply]:
    return [
        LateReply(dict(arrays), weight, origin, group) for arrays, weight, origin, group in held
    ]

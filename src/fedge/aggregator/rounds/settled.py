"""Rounds whose replies are all in: settled on arrival times, then folded.

Two of ``StreamingFedAvg``'s loops see a round's replies only once they are all in:

- the virtual clock (:func:`~fedge.aggregator.rounds.collect.collect_all`): replies come back at
  once and carry the time their work would have taken (``virtual-time-s``);
- Flower's own ``Strategy.start``: ``configure_train`` remembers its plan
  (:class:`Configured`) and ``aggregate_train`` gets every reply Flower collected
  (:func:`flower_collected` matches them to the plan; a party's latency is its
  ``virtual-time-s``, else the wall time from ``configure_train`` to its reply's creation).

Both are settled here the same way (:func:`settle_all`) -- same decoding, same fold order,
same failed and late replies -- so both give the same models for a seed. What Flower's
loop cannot do is end a round early: it waits for every reply.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from flwr.app import ArrayRecord, Message

from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.rounds import stale
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.replies import (
    Collected,
    check_reply,
    decode_arrays,
    reply_weight,
    sort_replies,
)


@dataclass(frozen=True)
class Configured:
    """What ``configure_train`` planned, for ``aggregate_train`` to settle."""

    server_round: int
    arrays: ArrayRecord
    plan: deadlines.RoundPlan
    tier: int | None
    sent_at: float  # Unix time, as a reply's ``metadata.created_at``


def flower_collected(configured: Configured, replies: Iterable[Message]) -> Collected:
    """The replies Flower's ``start`` collected, as our loops read them off the grid.

    Replies from parties not selected, and second replies, are ignored; a selected party
    without a reply failed.
    """
    selected = set(configured.plan.selected)
    by_node: dict[int, Message] = {}
    wall: dict[int, float] = {}
    for reply in replies:
        node = reply.metadata.src_node_id
        if node in selected and node not in by_node:
            by_node[node] = reply
            wall[node] = max(0.0, reply.metadata.created_at - configured.sent_at)
    return sort_replies(
        configured.plan.selected, by_node, wall, missing="no answer within Flower's timeout"
    )


def settle_all(
    plan: deadlines.RoundPlan,
    collected: Collected,
    folds: dict[str, StreamingMean],
    *,
    server_round: int,
    key: str,
    sent: Sequence[ArrayRecord],
    echoes: Sequence[ArrayRecord],
    fold_group: Callable[[int], str],
    keep_late: bool,
) -> tuple[deadlines.Settlement, list[stale.LateReply]]:
    """Settle ``collected`` on its arrival times and fold its on-time replies into ``folds``.

    A malformed reply is a failed party, refused before the round settles. On-time replies
    are folded in arrival order, into the group ``fold_group`` names (after whatever
    ``folds`` already holds: the late replies of earlier rounds). Late replies are returned
    decoded when ``keep_late`` (to be folded in a later round), else dropped.
    """
    for node, reply in collected.replies.items():
        if collected.arrivals.get(node) is None:
            continue
        try:
            check_reply(reply, key, sent, echoes)
        except ValueError as exc:
            collected.fail(node, f"malformed reply: {exc}")
    settlement = deadlines.settle(plan, collected.arrivals)
    for node in settlement.on_time:  # in arrival order
        reply = collected.replies[node]
        fold = folds.setdefault(fold_group(node), StreamingMean())
        fold.add(decode_arrays(reply, key, echoes), reply_weight(reply))
    if not keep_late:
        return settlement, []
    held = [
        stale.hold(collected.replies[node], key, echoes, server_round, fold_group(node))
        for node in settlement.late
    ]
    return settlement, held

"""The collect loops: the only place a strategy talks to the Grid (push, then pull).

Flower's ``Strategy.start`` sends a round's messages and waits for every reply
(``grid.send_and_receive``): one straggler decides the round's length. These loops pull
replies as they arrive instead:

- :func:`collect_all` (virtual clock): every reply comes back at once carrying the time
  its work would have taken, so the loop waits for all of them and the round is settled
  afterwards on the reported times (deterministic for a seed);
- :class:`ReplyStream` (wall clock): each reply is handed to the strategy as it is pulled
  (to be folded and let go); the round ends at its k-of-n quorum or its deadline,
  whichever comes first (FedCS, Nishio & Yonetani, ICC'19). Parties still working are
  *late*; their message ids stay pending when late replies are kept, so a reply that
  comes in a later round is handed over as a straggler (FedBuff's staleness folding,
  Nguyen et al., AISTATS'22).

A failed or missing reply is data (:class:`~fedge.aggregator.rounds.replies.Collected`), never a
reason to wait longer than the round's timeout.

:class:`PolledGrid` gives code that only knows ``send_and_receive`` (Flower's SecAgg+
workflow) the same loop: Flower's deployment grid sleeps 3 s between pulls, so its
``send_and_receive`` ends up to 3 s past its timeout and paces every stage to 3 s.
"""

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from flwr.app import Message
from flwr.serverapp import Grid

from fedge.aggregator.fleet.grids import WrappedGrid
from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.rounds.replies import Collected, no_reply_reason, sort_replies

FoldFn = Callable[[str, Message], None]
"""Fold an on-time reply into fold group ``group``; ValueError: the reply is malformed."""
StragglerFn = Callable[[Message, int, str], None]
"""A reply to round ``origin_round``'s message, pulled in a later round (with its group)."""


def collect_all(
    grid: Grid, messages: list[Message], timeout: float, pull_interval_s: float
) -> Collected:
    """Virtual clock: push, then pull until every party answered or ``timeout`` passed."""
    pushed = grid.push_messages(messages)
    ids = {mid: m.metadata.dst_node_id for mid, m in zip(pushed, messages, strict=True)}
    replies: dict[int, Message] = {}
    wall: dict[int, float] = {}
    started = time.monotonic()
    backoff = Backoff(pull_interval_s)
    while len(replies) < len(ids) and time.monotonic() < started + timeout:
        got = list(grid.pull_messages([i for i in ids if ids[i] not in replies]))
        for reply in got:
            node = ids[reply.metadata.reply_to_message_id]
            replies[node] = reply
            wall[node] = time.monotonic() - started
        if len(replies) < len(ids):
            backoff.wait(progressed=bool(got))
    missing = no_reply_reason(time.monotonic() - started, timeout)
    return sort_replies(list(ids.values()), replies, wall, missing=missing)


@dataclass(frozen=True)
class _Pending:
    node: int
    server_round: int
    pushed_at: float  # time.monotonic()
    group: str  # the fold group the reply belongs to


class ReplyStream:
    """Wall clock: push a round's messages, hand each reply over as it is pulled.

    Keeps the message ids still awaited across rounds (late replies of earlier rounds).
    """

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def collect(
        self,
        server_round: int,
        grid: Grid,
        messages: list[Message],
        plan: deadlines.RoundPlan,
        timeout: float,
        *,
        groups: Mapping[int, str],
        fold: FoldFn,
        straggler: StragglerFn,
        keep_late: bool,
        pull_interval_s: float,
    ) -> tuple[Collected, deadlines.Settlement]:
        """Pull until the quorum, the deadline or ``timeout``; ``fold`` each on-time reply.

        ``groups[node]``: the fold group of ``node``'s reply. Only folded replies are kept
        in the result's ``replies`` (a reply is emptied as it is folded).
        """
        started = time.monotonic()
        message_ids = list(grid.push_messages(messages))
        for mid, message in zip(message_ids, messages, strict=True):
            node = message.metadata.dst_node_id
            self._pending[mid] = _Pending(node, server_round, started, groups[node])
        collected = Collected({}, {}, {})
        on_time: list[int] = []
        limit = plan.deadline_s if plan.deadline_s is not None else timeout
        end = started + min(limit, timeout)
        this_round = set(message_ids)
        backoff = Backoff(pull_interval_s)
        while True:
            now = time.monotonic()
            pulled = list(grid.pull_messages(list(self._pending)))
            for reply in pulled:
                pending = self._pending.pop(reply.metadata.reply_to_message_id)
                if pending.server_round != server_round:  # a straggler from an earlier round
                    straggler(reply, pending.server_round, pending.group)
                    continue
                node = pending.node
                if reply.has_error():
                    collected.fail(node, str(reply.error.reason or ""))
                    continue
                try:
                    # Fold now, array by array, and let the reply go: memory stays at one
                    # model. A malformed reply (no or a bad weight, arrays that are not the
                    # model sent) is refused before anything is folded: a failed party.
                    fold(pending.group, reply)
                except ValueError as exc:
                    collected.fail(node, f"malformed reply: {exc}")
                    continue
                collected.arrivals[node] = now - pending.pushed_at
                collected.replies[node] = reply
                on_time.append(node)
            outstanding = [m for m in this_round if m in self._pending]
            # The round ends at its quorum, when nobody is left, or at the deadline.
            if len(on_time) >= plan.quorum or not outstanding or time.monotonic() >= end:
                break
            backoff.wait(progressed=bool(pulled))
        late = tuple(self._pending[m].node for m in this_round if m in self._pending)
        if not keep_late:
            for mid in [m for m in this_round if m in self._pending]:
                del self._pending[mid]  # replies to these ids are ignored when they come
        settlement = deadlines.Settlement(
            on_time=tuple(on_time),
            late=late,
            failed=tuple(n for n, t in collected.arrivals.items() if t is None),
            round_time_s=time.monotonic() - started,
            quorum_met=len(on_time) >= plan.quorum,
        )
        return collected, settlement


class Backoff:
    """Poll fast while replies are coming, then back off to ``ceiling_s``.

    A fixed interval costs up to a whole interval per round even when the replies are
    already there (in-process rounds take a few milliseconds); starting at 0.5 ms and
    doubling keeps idle polling cheap in a long deployment round.
    """

    def __init__(self, ceiling_s: float, floor_s: float = 0.0005) -> None:
        self.floor_s = min(floor_s, ceiling_s)
        self.ceiling_s = ceiling_s
        self.current_s = self.floor_s

    def wait(self, *, progressed: bool) -> None:
        if progressed:
            self.current_s = self.floor_s
        time.sleep(self.current_s)
        self.current_s = min(self.current_s * 2, self.ceiling_s)


class PolledGrid(WrappedGrid):
    """``send_and_receive`` as our collect loops do it: push, then pull with
    :class:`Backoff` (at most ``ceiling_s`` apart) until every reply is in or ``timeout``
    has passed on the monotonic clock.

    So a wait ends within ``timeout + ceiling_s`` plus one pull, whatever the grid behind
    it does between pulls: a party that died silently costs at most the caller's timeout.
    (Flower 1.41's SuperLink answers for a dead node only once its heartbeat expires:
    ``HEARTBEAT_PATIENCE`` 2 x the SuperNode's 30 s interval after its last heartbeat,
    which it sends every 17.5-22.5 s, so 37.5-60 s after the death.)
    """

    def __init__(self, inner: Grid, ceiling_s: float = 0.01) -> None:
        super().__init__(inner)
        self.ceiling_s = ceiling_s

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        waiting = {m for m in self.push_messages(messages) if m}
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        backoff = Backoff(self.ceiling_s)
        while waiting:
            got = list(self.pull_messages(waiting))
            replies.extend(got)
            waiting -= {r.metadata.reply_to_message_id for r in got}
            if not waiting or (end is not None and time.monotonic() >= end):
                break
            backoff.wait(progressed=bool(got))
        return replies

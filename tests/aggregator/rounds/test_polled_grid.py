"""PolledGrid: ``send_and_receive`` ends on our own clock, whatever the grid behind it does.

Flower's deployment grid sleeps 3 s between pulls, and its SuperLink says a SIGKILLed node
is gone only once its heartbeat expires (37.5-60 s): a wait for a dead party must end at
the caller's timeout (issue 25 item 6). A literal grid, no network.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message, MessageType, RecordDict

from fedge.aggregator.fleet.grids import LocalGrid
from fedge.aggregator.rounds.collect import PolledGrid

ALIVE, DEAD = (1000, 1001), 1002


class SilentNodeGrid(LocalGrid):
    """Nodes in ``ALIVE`` answer every message after ``delay_s``; ``DEAD`` never does."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.pushed: dict[str, tuple[Message, float]] = {}
        self.pulls = 0

    def get_node_ids(self) -> Iterable[int]:
        return [*ALIVE, DEAD]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for index, message in enumerate(messages):
            message_id = f"m{len(self.pushed) + index}"
            message.metadata.__dict__["_message_id"] = message_id
            self.pushed[message_id] = (message, time.monotonic())
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self.pulls += 1
        replies = []
        for message_id in message_ids:
            message, at = self.pushed[message_id]
            node = message.metadata.dst_node_id
            if node in ALIVE and time.monotonic() - at >= self.delay_s:
                reply = Message(RecordDict(), reply_to=message)
                reply.metadata.__dict__["_src_node_id"] = node
                replies.append(reply)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        raise AssertionError("PolledGrid pulls itself; Flower's loop sleeps 3 s between pulls")


def _messages() -> list[Message]:
    return [
        Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
        for node in [*ALIVE, DEAD]
    ]


def test_a_silent_node_costs_the_timeout_and_the_others_replies_come_back() -> None:
    grid = SilentNodeGrid(delay_s=0.05)
    started = time.monotonic()
    replies = list(PolledGrid(grid, ceiling_s=0.01).send_and_receive(_messages(), timeout=0.3))
    waited = time.monotonic() - started
    assert sorted(r.metadata.src_node_id for r in replies) == list(ALIVE)
    # Our clock ends the wait: the timeout plus at most about one pull interval.
    assert 0.3 <= waited < 0.3 + 0.1
    assert grid.pulls > 10  # pulled often, not once every few seconds


def test_when_everyone_answers_the_wait_ends_with_the_last_reply() -> None:
    grid = SilentNodeGrid(delay_s=0.05)
    alive = [m for m in _messages() if m.metadata.dst_node_id in ALIVE]
    started = time.monotonic()
    replies = list(PolledGrid(grid, ceiling_s=0.01).send_and_receive(alive, timeout=30.0))
    assert len(replies) == 2 and time.monotonic() - started < 1.0

"""Grids the strategies run on, whatever sits behind them: the common part of Flower's contract.

``LocalGrid`` is its own link (an in-process or benchmark grid holds its Run);
``WrappedGrid`` stands in front of another grid and changes what the strategy sees.
"""

import time
from collections.abc import Iterable, Mapping

from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

# Node ids fedge shows a strategy: NODE_ID_BASE + the party's index (Flower reserves 0, 1).
NODE_ID_BASE = 1000
UserConfig = Mapping[str, bool | int | float | str]


def wait_for_nodes(grid: Grid, count: int, wait_s: float, poll_s: float = 0.5) -> int:
    """Wait until ``grid`` shows at least ``count`` nodes or ``wait_s`` pass; how many it
    shows. A ServerApp starts beside its nodes, not after them: Flower's simulation
    runtime registers its virtual nodes while the ServerApp already runs, so a strategy
    that samples at once can find none (Flower's own strategies wait in ``sample_nodes``)."""
    end = time.monotonic() + wait_s
    while True:
        seen = len(list(grid.get_node_ids()))
        if seen >= count or time.monotonic() >= end:
            return seen
        time.sleep(poll_s)


class LocalGrid(Grid):
    """A Grid that is its own link: it holds the Run and builds plain Flower messages.

    The parts of Flower's Grid contract that every such grid does the same way; subclasses
    say which nodes exist and how messages reach them.
    """

    def __init__(self, run_id: int = 1, run_config: UserConfig | None = None) -> None:
        # What Flower's ServerApp runtime sets for the process: messages read it.
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        self._run = Run.create_empty(run_id)
        self._run.override_config = dict(run_config or {})

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)


class WrappedGrid(Grid):
    """A Grid in front of another (``inner``): the Run is the inner grid's.

    Subclasses change what the strategy sees (node ids, which messages pass) and forward
    the rest: by default every call goes to ``inner`` as it is.
    """

    def __init__(self, inner: Grid) -> None:
        self.inner = inner

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.inner.send_and_receive(messages, timeout=timeout)

    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        return self.inner.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

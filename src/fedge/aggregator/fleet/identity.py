"""Which party is which node: node ids the strategy can keep, whatever the runtime draws.

Flower gives its nodes random 64-bit ids, and a SuperNode that restarts comes back as a
new node. fedge's strategies sample from ``sorted(grid.get_node_ids())`` and keep
per-party state (latency profiles, tiers), so :class:`IdentifiedGrid` asks every node once
who it is and shows the strategy a stable id per party, translating destinations on push
and sources on pull. Simulated parties answer with their partition id; a station answers
with its edge id (``fedge.party.station_app``); a ClientApp that cannot answer is shown
under its own node id.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Literal

from flwr.app import Message, MessageType, RecordDict
from flwr.app.message import make_message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore import log

from fedge.aggregator.fleet.grids import NODE_ID_BASE, WrappedGrid

DISCOVERY_TIMEOUT_S = 120.0
# Flower's error codes for a message its node was not there to take or answer
# (flwr.common.constant.ErrorCode): the node may come back, so it is not written off.
_UNAVAILABLE = frozenset(
    {ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, ErrorCode.NODE_UNAVAILABLE}
)
METRICS_KEY = "metrics"
PARTITION_ID_KEY = "partition-id"
IDENTITY_KEY = "identity"
EDGE_KEY = "edge"

Identify = Callable[[Message], "tuple[int, str] | str"]
"""A query reply -> (the id to show, a name), or the reason the node takes no part."""
Unidentified = Literal["node-id", "exclude"]


def identify_partition(reply: Message) -> tuple[int, str] | str:
    """A simulated party: ``{"partition-id": n}`` in its metrics -> ``1000 + n``."""
    value = None
    for key, record in reply.content.metric_records.items():
        if key == METRICS_KEY or PARTITION_ID_KEY in record:
            value = record.get(PARTITION_ID_KEY)
            break
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"query reply has no partition id ({value!r})"
    return NODE_ID_BASE + value, f"partition-{value}"


def identify_station(edges: Mapping[str, int]) -> Identify:
    """Stations of a job: ``{"edge": "st-01"}`` in the reply's config -> the edge's id."""

    def identify(reply: Message) -> tuple[int, str] | str:
        record = reply.content.config_records.get(IDENTITY_KEY)
        edge = None if record is None else record.get(EDGE_KEY)
        if not isinstance(edge, str) or not edge:
            return "query reply names no edge (not a fedge station?)"
        if edge not in edges:
            return f"edge {edge!r} is not a party of this job"
        return edges[edge], edge

    return identify


class IdentifiedGrid(WrappedGrid):
    """A Flower ``Grid`` whose node ids name parties, whatever ids the runtime gave nodes.

    Wraps another Grid (Flower's in-memory grid in simulation, its HTTP grid in
    deployment). Every node is asked once, the first time it is seen, who it is (a
    ``QUERY`` message); ``identify`` turns the reply into the id the strategy sees
    (``1000 + partition-id`` for simulated parties, ``1000 + index`` of a station in
    its job) or into a reason the node takes no part. Nodes that have not answered yet
    are not shown. A ClientApp written without a query handler (Flower's quickstart
    style) answers with an error: with ``unidentified = "node-id"`` it is shown under the
    runtime's own node id, so any Flower ClientApp can take part; with ``"exclude"`` it
    is left out (a fleet job trains only on its stations).

    Messages stay Flower ``Message`` objects: a pushed message is copied with the real
    destination (the caller's object keeps the id it was given and gets the message id),
    and a pulled reply's source is rewritten to the id the strategy knows.
    """

    def __init__(
        self,
        grid: Grid,
        *,
        identify: Identify | None = None,
        unidentified: Unidentified = "node-id",
        discovery_timeout_s: float = DISCOVERY_TIMEOUT_S,
        pull_interval_s: float = 0.02,
    ) -> None:
        super().__init__(grid)
        self.identify: Identify = identify or identify_partition
        self.unidentified = unidentified
        self.discovery_timeout_s = discovery_timeout_s
        self.pull_interval_s = pull_interval_s
        self._shown_of: dict[int, int] = {}  # real node id -> 1000 + partition id
        self._real_of: dict[int, int] = {}  # 1000 + partition id -> real node id
        self._asked: dict[str, int] = {}  # query message id -> real node id
        self._unusable: dict[int, str] = {}  # real node id -> why it cannot be placed
        self._names: dict[int, str] = {}  # shown id -> what the node said it is

    # -- what the strategy sees

    @property
    def excluded(self) -> dict[int, str]:
        """Real node id -> why it is not shown (its query failed, or it is no party here)."""
        return dict(self._unusable)

    @property
    def names(self) -> dict[int, str]:
        """Shown node id -> the party's name as its reply gave it (e.g. the edge id)."""
        return dict(self._names)

    @property
    def partition_map(self) -> dict[int, int]:
        """Shown node id -> the runtime's real node id, for every node placed so far."""
        return dict(self._real_of)

    def real_node_id(self, node_id: int) -> int:
        try:
            return self._real_of[node_id]
        except KeyError:
            raise ValueError(f"no node {node_id} in this grid") from None

    def shown_node_id(self, real_node_id: int) -> int:
        return self._shown_of.get(real_node_id, real_node_id)

    # -- Grid contract (set_run, run and create_message are WrappedGrid's)

    def get_node_ids(self) -> Iterable[int]:
        real = list(self.inner.get_node_ids())
        self._discover(real)
        # A party that came back as a new node is shown once, as its newest node.
        return sorted(
            self._shown_of[node]
            for node in real
            if node in self._shown_of and self._real_of[self._shown_of[node]] == node
        )

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        originals = list(messages)
        copies = [
            self._with_destination(m, self.real_node_id(m.metadata.dst_node_id)) for m in originals
        ]
        message_ids = list(self.inner.push_messages(copies))
        for original, sent in zip(originals, copies, strict=True):
            original.metadata.__dict__["_message_id"] = sent.metadata.message_id
        return message_ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            self._translate_reply(reply)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        waiting = {m for m in self.push_messages(messages) if m}
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while waiting:
            got = list(self.pull_messages(waiting))
            replies.extend(got)
            waiting -= {r.metadata.reply_to_message_id for r in got}
            if not waiting or (end is not None and time.monotonic() >= end):
                break
            time.sleep(self.pull_interval_s)
        return replies

    # -- discovery

    def _discover(self, real_ids: list[int]) -> None:
        asked = set(self._asked.values())
        new = [
            n
            for n in real_ids
            if n not in self._shown_of and n not in asked and n not in self._unusable
        ]
        sent: set[str] = set()
        if new:
            queries = [
                Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY)
                for node in new
            ]
            pushed = {m for m in self.inner.push_messages(queries) if m}
            # Flower's grids set each message's id on the object they push (and leave out
            # of the returned ids a message they could not store).
            for node, query in zip(new, queries, strict=True):
                message_id = query.metadata.message_id
                if message_id and message_id in pushed:
                    self._asked[message_id] = node
                    sent.add(message_id)
                else:
                    self._unusable[node] = "the query could not be pushed"
        # Wait for the queries just sent; answers to older ones are taken as they come.
        end = time.monotonic() + self.discovery_timeout_s
        while True:
            if self._asked:
                for reply in self.inner.pull_messages(list(self._asked)):
                    self._place(reply)
            if not sent & set(self._asked) or time.monotonic() >= end:
                break
            time.sleep(self.pull_interval_s)
        for message_id in sent & set(self._asked):
            log(
                WARNING,
                "node %s did not say its partition id within %.0fs",
                self._asked[message_id],
                self.discovery_timeout_s,
            )

    def _place(self, reply: Message) -> None:
        node = self._asked.pop(reply.metadata.reply_to_message_id, None)
        if node is None:
            return
        if reply.has_error():
            if reply.error.code in _UNAVAILABLE:
                # The node was not there to answer: a SuperNode killed and not yet back
                # (Flower keeps its node listed for up to a minute), or one re-activating.
                # It is asked again the next time it is listed, so a job that waits for its
                # stations (node_wait_s) takes it when it returns (issue 27).
                log(
                    INFO,
                    "node %s did not answer who it is (%s); asked again when it is back",
                    node,
                    str(reply.error.reason)[:200],
                )
                return
            if self.unidentified == "node-id" and node not in self._real_of:
                # A ClientApp that cannot answer QUERY (no handler): shown as itself.
                self._real_of[node] = node
                self._shown_of[node] = node
                log(
                    INFO,
                    "node %s does not say who it is (%s); shown as itself",
                    node,
                    str(reply.error.reason)[:200],
                )
                return
            self._unusable[node] = f"query failed: {reply.error.reason}"
            log(WARNING, "node %s cannot be placed: %s", node, self._unusable[node])
            return
        identity = self.identify(reply)
        if isinstance(identity, str):
            self._unusable[node] = identity
            log(WARNING, "node %s takes no part: %s", node, identity)
            return
        shown, name = identity
        previous = self._real_of.get(shown)
        if previous is not None and previous != node:
            # The same party came back as a new node (a restarted SuperNode): it replaces
            # the old one, whose late replies are still recognised.
            log(WARNING, "party %s moved from node %s to node %s", name, previous, node)
        self._real_of[shown] = node
        self._shown_of[node] = shown
        self._names[shown] = name

    # -- message translation

    @staticmethod
    def _with_destination(message: Message, real_node_id: int) -> Message:
        metadata = copy.copy(message.metadata)
        metadata.dst_node_id = real_node_id
        return make_message(metadata, content=message.content)

    def _translate_reply(self, reply: Message) -> None:
        fields = reply.metadata.__dict__
        for key in ("_src_node_id", "_dst_node_id"):
            if fields[key] in self._shown_of:
                fields[key] = self._shown_of[fields[key]]


class PartitionOrderedGrid(IdentifiedGrid):
    """Simulated parties shown as ``1000 + partition-id`` (Flower's simulation runtime)."""

    def __init__(
        self,
        grid: Grid,
        *,
        discovery_timeout_s: float = DISCOVERY_TIMEOUT_S,
        pull_interval_s: float = 0.02,
    ) -> None:
        super().__init__(
            grid,
            identify=identify_partition,
            unidentified="node-id",
            discovery_timeout_s=discovery_timeout_s,
            pull_interval_s=pull_interval_s,
        )

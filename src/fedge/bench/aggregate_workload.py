"""The aggregation benchmark's synthetic workload: a model, its updates, the replies.

A ``params``-parameter float32 model in six arrays (:data:`MODEL_SPLIT`: 40 %, 25 %, 15 %,
10 %, 6 % and 4 % of the parameters, as a small network's layers would), each party's
update drawn deterministically from ``(seed, party)`` (:func:`party_update`), the reply a
party sends (:func:`reply_content`: an ``ArrayRecord`` and a ``MetricRecord`` with
``num-examples``), :class:`ReplyGrid`, the Flower ``Grid`` standing in for the SuperLink
that generates those replies one at a time as they are pulled, and the float64 mean of
the same updates (:func:`reference_mean`) that both sides' results are checked against.
Used by :mod:`fedge.bench.aggregate`.
"""

import time
from collections.abc import Iterable, Iterator
from typing import Any
from uuid import uuid4

import numpy as np
import numpy.typing as npt
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from fedge.aggregator.fleet.grids import NODE_ID_BASE, LocalGrid
from fedge.bench.testbed import BenchError

MODEL_SPLIT = (0.40, 0.25, 0.15, 0.10, 0.06, 0.04)  # shares of the parameters per array
ARRAYRECORD_KEY = "arrays"  # FedAvg's (and so StreamingFedAvg's) default arrayrecord_key
METRICRECORD_KEY = "metrics"
NUM_EXAMPLES = "num-examples"  # FedAvg's default weighted_by_key

MIN_PARAMS = 100


def array_sizes(params: int) -> list[int]:
    """Element counts of the model's arrays (:data:`MODEL_SPLIT`), summing to ``params``."""
    if params < MIN_PARAMS:
        raise BenchError(f"params must be at least {MIN_PARAMS}, got {params}")
    sizes = [max(1, int(params * share)) for share in MODEL_SPLIT[:-1]]
    sizes.append(params - sum(sizes))
    return sizes


def array_names(count: int) -> list[str]:
    return [f"layer{index}.weight" for index in range(count)]


def party_update(seed: int, party: int, sizes: list[int]) -> tuple[int, Iterator[npt.NDArray[Any]]]:
    """Party ``party``'s example count and its arrays, drawn lazily (one live at a time).

    Deterministic in ``(seed, party)`` whatever the order parties are asked in; the parent
    regenerates the same values for the float64 reference.
    """
    rng = np.random.default_rng([seed, party])
    weight = int(rng.integers(10, 1000))

    def arrays() -> Iterator[npt.NDArray[Any]]:
        for size in sizes:
            yield rng.standard_normal(size, dtype=np.float32)

    return weight, arrays()


def reply_content(seed: int, party: int, sizes: list[int]) -> RecordDict:
    weight, arrays = party_update(seed, party, sizes)
    record = ArrayRecord()
    for name, values in zip(array_names(len(sizes)), arrays, strict=True):
        record[name] = Array(values)  # serialized to bytes, as it comes off the wire
        del values  # else the previous array lives while the generator draws the next
    return RecordDict(
        {ARRAYRECORD_KEY: record, METRICRECORD_KEY: MetricRecord({NUM_EXAMPLES: weight})}
    )


class ReplyGrid(LocalGrid):
    """A Flower ``Grid`` whose parties reply with seeded random updates, one per pull.

    ``pull_messages`` hands back at most one reply, generated when it is pulled, so replies
    arrive one at a time and none exists before its arrival; ``send_and_receive`` pulls
    until every reply is in and returns them all, as Flower's grids do. The grid keeps no
    reference to a reply it has handed out. ``generate_s`` is the time spent generating.
    """

    def __init__(self, parties: int, sizes: list[int], *, seed: int, run_id: int = 1) -> None:
        super().__init__(run_id)
        self._nodes = [NODE_ID_BASE + party for party in range(parties)]
        self._sizes = sizes
        self._seed = seed
        self._pending: dict[str, Message] = {}  # message id -> instruction, in push order
        self.generate_s = 0.0
        self.replies_sent = 0

    def get_node_ids(self) -> Iterable[int]:
        return list(self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            if message.metadata.dst_node_id not in self._nodes:
                raise ValueError(f"no node {message.metadata.dst_node_id} in this grid")
            message_id = str(uuid4())
            message.metadata.__dict__["_message_id"] = message_id
            message.metadata.__dict__["_run_id"] = self._run.run_id
            self._pending[message_id] = message
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = set(message_ids)
        for message_id in self._pending:
            if message_id in wanted:
                return [self._reply(self._pending.pop(message_id))]
        return []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        waiting = list(self.push_messages(messages))
        replies: list[Message] = []
        for message_id in waiting:
            replies.extend(self.pull_messages([message_id]))
        return replies

    def _reply(self, instruction: Message) -> Message:
        started = time.perf_counter()
        party = instruction.metadata.dst_node_id - NODE_ID_BASE
        reply = Message(reply_content(self._seed, party, self._sizes), reply_to=instruction)
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        self.generate_s += time.perf_counter() - started
        self.replies_sent += 1
        return reply


def global_model(sizes: list[int]) -> ArrayRecord:
    """The server's current model, all zeros: every side holds it through its round."""
    names = array_names(len(sizes))
    return ArrayRecord(
        {name: Array(np.zeros(size, np.float32)) for name, size in zip(names, sizes, strict=True)}
    )


def reference_mean(
    updates: int, sizes: list[int], seed: int
) -> tuple[list[npt.NDArray[np.float64]], float]:
    """float64 weighted mean of the same seeded updates, and the largest |value| in them."""
    sums = [np.zeros(size, np.float64) for size in sizes]
    total = 0.0
    largest = 0.0
    for party in range(updates):
        weight, arrays = party_update(seed, party, sizes)
        total += weight
        for acc, values in zip(sums, arrays, strict=True):
            largest = max(largest, float(np.abs(values).max()))
            acc += weight * values.astype(np.float64)
    return [acc / total for acc in sums], largest

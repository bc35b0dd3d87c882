"""Reading replies: a party's model, weight, time and metrics, decoded from Flower messages.

Pure functions over Flower ``Message``s and ``ArrayRecord``s -- no Grid, no strategy
state -- shared by the collect loops (:mod:`fedge.aggregator.rounds.collect`) and by
``StreamingFedAvg.aggregate_train``, so both read a reply the same way:

- a reply's weight is its ``num-examples`` (FedAvg, McMahan et al., AISTATS'17); a weight
  no party can have (not a number, negative, infinite) makes the reply *malformed*;
- a reply whose arrays are not the model that was sent (names, shapes, dtypes) is
  malformed too; a malformed reply is a failed party, never folded;
- a reply's latency is the ``virtual-time-s`` it reports (simulation), else the wall time
  it took (:func:`sort_replies`);
- models are decoded one array at a time and each array is popped from the reply as it
  goes, so a reply's bytes and its decoded copy are never both whole in memory.
"""

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message

from fedge.aggregator.rounds.clock import VIRTUAL_TIME_KEY
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.privacy.settings import is_budget_exhausted

NUM_EXAMPLES = "num-examples"
FAILURE_REASON_CHARS = 300  # a failure's reason is kept in round records: keep it short

Layout = dict[str, tuple[tuple[int, ...], np.dtype[Any]]]


@dataclass
class Collected:
    """A round's replies as read off the grid, before the round is settled.

    ``arrivals[node]``: seconds from push to reply (virtual or wall), None for a party that
    failed or never answered; ``failures[node]`` says why. ``replies`` holds every reply
    that came, error replies included.
    """

    replies: dict[int, Message]
    arrivals: dict[int, float | None]
    failures: dict[int, str]
    exhausted: set[int] = field(default_factory=set)
    """Failed parties that refused for their privacy budget: told by the whole reason,
    before it is cut (Ray puts hundreds of characters ahead of the exception's class)."""

    def fail(self, node: int, reason: str) -> None:
        self.arrivals[node] = None
        if is_budget_exhausted(reason):
            self.exhausted.add(node)
        self.failures[node] = reason[:FAILURE_REASON_CHARS]


def no_reply_reason(elapsed_s: float, timeout_s: float, *, delivered: bool = True) -> str:
    """Why a party's reply is missing, with the time really waited (issue 27: "no reply
    within 120s" was once said 58 s after the messages went out)."""
    if not delivered:
        return (
            f"not delivered: the SuperLink did not take the message for this node (it was "
            f"not connected when the message was sent); waited {elapsed_s:.0f} s for the "
            "others"
        )
    if elapsed_s >= timeout_s:
        return f"no reply within the {timeout_s:.0f} s allowed (waited {elapsed_s:.0f} s)"
    return f"no reply after {elapsed_s:.0f} s of the {timeout_s:.0f} s allowed"


def sort_replies(
    selected: Sequence[int],
    replies: Mapping[int, Message],
    wall_s: Mapping[int, float],
    *,
    missing: str,
) -> Collected:
    """Each selected party's arrival time or failure, from the replies that came.

    A ClientApp that knows nothing of virtual time is timed on the wall (``wall_s``).
    """
    collected = Collected(dict(replies), {}, {})
    for node in selected:
        answer = replies.get(node)
        if answer is None:
            collected.fail(node, missing)
        elif answer.has_error():
            collected.fail(node, str(answer.error.reason or ""))
        else:
            virtual = virtual_time(answer)
            collected.arrivals[node] = wall_s[node] if virtual is None else virtual
    return collected


def arrays_of(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: array.numpy() for key, array in record.items()}


def to_array_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord(
        array_dict={key: Array(np.ascontiguousarray(value)) for key, value in arrays.items()}
    )


def serialise(fold: StreamingMean) -> ArrayRecord:
    """The fold's mean as an ArrayRecord, one array at a time (no second full copy)."""
    record = ArrayRecord()
    for key, mean in fold.take_result():
        record[key] = Array(np.ascontiguousarray(mean))
        del mean
    return record


def layout(record: ArrayRecord) -> Layout:
    """Names, shapes and dtypes of a model's arrays, read without decoding them."""
    return {k: (tuple(a.shape), np.dtype(a.dtype)) for k, a in record.items()}


def model_record(message: Message, key: str) -> ArrayRecord:
    """The reply's model record (``content[key]``, see :func:`decode_arrays`)."""
    record = message.content.get(key)  # a reply without it is malformed: a failed party
    if not isinstance(record, ArrayRecord):
        raise ValueError(f"reply's {key!r} is not an ArrayRecord")
    return record


def check_reply(
    message: Message, key: str, sent: Sequence[ArrayRecord], echoes: Sequence[ArrayRecord]
) -> float:
    """The reply's weight, once its model is known to be one of ``sent`` (else ValueError).

    Reads no array: a reply is refused before anything of it is folded. A record in
    ``echoes`` is a model we sent, echoed back by an in-process party: it fits.
    """
    record = model_record(message, key)
    weight = reply_weight(message)
    if sent and not any(record is echo for echo in echoes):
        found = layout(record)
        if not any(found == layout(model) for model in sent):
            raise ValueError("its arrays are not the model that was sent (names or shapes)")
    return weight


def decode_arrays(
    message: Message, key: str, echoes: Sequence[ArrayRecord]
) -> dict[str, np.ndarray]:
    """Decode a reply's model, emptying the reply as it goes.

    ``content[key]``, not ``content.array_records[key]``: the latter is a view that
    refers to itself, so the reply's arrays would outlive it until the cyclic GC ran.
    Popping each array as it is decoded keeps one array's bytes, not the model's,
    alongside the decoded copy (the aggregation benchmark measures this). A record in
    ``echoes`` (an in-process party echoed a model we sent) is read, never emptied.
    """
    record = model_record(message, key)
    if any(record is echo for echo in echoes):
        return arrays_of(record)
    return dict(_popped(record))


def fold_reply(
    fold: StreamingMean,
    message: Message,
    key: str,
    sent: Sequence[ArrayRecord],
    echoes: Sequence[ArrayRecord],
) -> None:
    """Check a reply (:func:`check_reply`), then fold it one array at a time, emptying it.

    Peak memory is the fold plus one array, not plus one model.
    """
    weight = check_reply(message, key, sent, echoes)
    record = model_record(message, key)
    if any(record is echo for echo in echoes):  # an in-process echo: don't empty it
        fold.add(arrays_of(record), weight)
        return
    fold.add_streamed(layout(record), _popped(record), weight)


def reply_weight(message: Message) -> float:
    """The reply's ``num-examples``: its share of the mean."""
    for record in message.content.metric_records.values():
        if NUM_EXAMPLES in record:
            value = record[NUM_EXAMPLES]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"'{NUM_EXAMPLES}' is not a number: {value!r}")
            weight = float(value)
            # A party's weight decides its share of the model: refuse what no party has.
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"'{NUM_EXAMPLES}' must be a finite number >= 0, got {value!r}")
            return weight
    raise ValueError(f"reply from node {message.metadata.src_node_id} has no '{NUM_EXAMPLES}'")


def virtual_time(message: Message) -> float | None:
    """The ``virtual-time-s`` a simulated party reports (None: not simulated)."""
    for record in message.content.metric_records.values():
        if VIRTUAL_TIME_KEY in record:
            return float(record[VIRTUAL_TIME_KEY])  # type: ignore[arg-type]
    return None


def weighted_metrics(replies: Sequence[Message]) -> dict[str, float]:
    """The replies' numeric metrics, averaged with their ``num-examples`` as weights."""
    totals: dict[str, float] = {}
    weight_sum = 0.0
    for reply in replies:
        weight = reply_weight(reply)
        weight_sum += weight
        for record in reply.content.metric_records.values():
            for key, value in record.items():
                if isinstance(value, int | float) and key != NUM_EXAMPLES and math.isfinite(value):
                    totals[key] = totals.get(key, 0.0) + weight * float(value)
    return {k: v / weight_sum for k, v in totals.items()} if weight_sum else {}


def _popped(record: ArrayRecord) -> Iterator[tuple[str, np.ndarray]]:
    for key in list(record.keys()):
        yield key, record.pop(key).numpy()

"""The sim-overhead benchmark's party side: one echo ``ClientApp`` for every side.

:data:`echo_app` answers a train message with the arrays it received and a
``num-examples`` of ``8 + partition % 5`` (training costs nothing, so a round is all
orchestration), an evaluate message with that count and a zero accuracy, and a query with
its partition id (what ``PartitionOrderedGrid`` asks every node once).
:func:`initial_arrays` is the small float32 model the strategies start from. The app is
handed to the grids as an object (``InProcessGrid``, ``launch_simulation``), not by a
module path string. Used by :mod:`fedge.bench.sim_overhead_runs`.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
NUM_EXAMPLES = "num-examples"
PARTITION_ID = "partition-id"
BASE_EXAMPLES = 8  # "a handful of samples": party p reports 8 + p % 5 examples


echo_app = ClientApp()


def _partition_id(context: Context) -> int:
    value = context.node_config.get(PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"node_config['{PARTITION_ID}'] must be an int, got {value!r}")
    return value


@echo_app.train()
def echo_train(msg: Message, context: Context) -> Message:
    """Reply with the received arrays and a ``num-examples``: no training at all."""
    arrays = msg.content[ARRAYS_KEY]
    partition = _partition_id(context)
    metrics = MetricRecord({NUM_EXAMPLES: BASE_EXAMPLES + partition % 5, PARTITION_ID: partition})
    return Message(RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: metrics}), reply_to=msg)


@echo_app.evaluate()
def echo_evaluate(msg: Message, context: Context) -> Message:
    partition = _partition_id(context)
    metrics = MetricRecord({NUM_EXAMPLES: BASE_EXAMPLES + partition % 5, "eval-acc": 0.0})
    return Message(RecordDict({METRICS_KEY: metrics}), reply_to=msg)


@echo_app.query()
def echo_query(msg: Message, context: Context) -> Message:
    """Which partition this node is (what ``PartitionOrderedGrid`` asks every node once)."""
    metrics = MetricRecord({PARTITION_ID: _partition_id(context)})
    return Message(RecordDict({METRICS_KEY: metrics}), reply_to=msg)


def initial_arrays(params: int, seed: int) -> ArrayRecord:
    """A ``params``-parameter float32 model in two arrays (a weight matrix and a bias)."""
    bias = max(1, params // 100)
    rng = np.random.default_rng(seed)
    return ArrayRecord(
        array_dict={
            "weight": Array(rng.standard_normal(params - bias).astype(np.float32)),
            "bias": Array(np.zeros(bias, np.float32)),
        }
    )

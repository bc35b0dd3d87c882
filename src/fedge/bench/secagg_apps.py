"""The SecAgg+ benchmark's party: a synthetic-update ``ClientApp`` behind ``secagg_mod``.

:data:`secagg_app` answers a train message (plain or SecAgg+) with
:func:`party_update` -- the received model plus a small deterministic offset of its own,
so every party's update differs and the plain weighted mean is known exactly -- and the
metrics our strategies read: ``num-examples`` (``8 + partition % 5``), ``local-acc``
(``0.1 * (partition % 4)``) and ``virtual-time-s`` (``1 + partition``: the fleet's tiers
are known in advance). It answers a query with its partition id (what
``PartitionOrderedGrid`` asks every node once).

A party can be made to die mid-protocol (the "killed party" of the SecAgg+ tests and the
benchmark's ``dropouts_survived``): the round config's ``drop-partition`` names it and
``drop-stage`` says where -- ``collect`` (it raises instead of training: no masked
vector) or ``unmask`` (it sent its masked vector, then raises instead of sending its key
shares) -- both leave an error reply -- or ``silent``: on real processes only, it writes
``silent-<partition>`` into the node's ``signal-dir`` (node config) and hangs before its
masked vector, so its SuperNode can be SIGKILLed mid-round and nothing is ever sent
(:mod:`fedge.bench.secagg_silent`). Used by :mod:`fedge.bench.secagg` and the SecAgg+
tests.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from fedge.party.messages import ARRAYS_KEY, METRICS_KEY, global_arrays, round_config
from fedge.party.secagg import FITINS_CONFIG, is_secagg_message, secagg_mod

PARTITION_ID = "partition-id"
DROP_PARTITION = "drop-partition"
DROP_STAGE = "drop-stage"
SIGNAL_DIR = "signal-dir"
SILENT = "silent"
SILENT_HANG_S = 600.0  # far past any stage timeout; the node is killed long before
BASE_EXAMPLES = 8
OFFSET_SCALE = 0.01
_DROP_STATE = "fedge-drop"


class PartyKilledError(RuntimeError):
    """The party was told to die at this stage of the protocol (a test and bench knob)."""


def examples_of(partition: int) -> int:
    return BASE_EXAMPLES + partition % 5


def local_accuracy_of(partition: int) -> float:
    return 0.1 * (partition % 4)


def party_update(arrays: dict[str, np.ndarray], partition: int) -> dict[str, np.ndarray]:
    """What party ``partition`` sends back for ``arrays``: each value moved by its offset."""
    updated = {}
    for index, (name, values) in enumerate(arrays.items()):
        rng = np.random.default_rng([partition, index])
        offset = OFFSET_SCALE * rng.standard_normal(values.shape)
        updated[name] = (values + offset).astype(values.dtype)
    return updated


def drop_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Die at the stage the round config names, if this party is the one named."""
    partition = _partition_id(context)
    if is_secagg_message(message):
        stage = message.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)
        if stage == Stage.COLLECT_MASKED_VECTORS:
            config = message.content.config_records.get(FITINS_CONFIG, ConfigRecord())
            doomed = config.get(DROP_PARTITION) == partition
            context.state.config_records[_DROP_STATE] = ConfigRecord(
                {DROP_STAGE: str(config.get(DROP_STAGE, "")) if doomed else ""}
            )
            if doomed and config.get(DROP_STAGE) == "collect":
                raise PartyKilledError(f"partition {partition} killed before its masked vector")
            if doomed and config.get(DROP_STAGE) == SILENT:
                _hang_until_killed(context, partition)
        if stage == Stage.UNMASK:
            state = context.state.config_records.get(_DROP_STATE, ConfigRecord())
            if state.get(DROP_STAGE) == "unmask":
                raise PartyKilledError(f"partition {partition} killed before unmasking")
    return call_next(message, context)


secagg_app = ClientApp(mods=[drop_mod, secagg_mod])


@secagg_app.train()
def train(msg: Message, context: Context) -> Message:
    partition = _partition_id(context)
    config = round_config(msg)
    if config.get(DROP_PARTITION) == partition and config.get(DROP_STAGE) == "collect":
        raise PartyKilledError(f"partition {partition} killed before training")
    received = {k: a.numpy() for k, a in global_arrays(msg).items()}
    update = party_update(received, partition)
    arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in update.items()})
    metrics = MetricRecord(
        {
            "num-examples": examples_of(partition),
            "local-acc": local_accuracy_of(partition),
            "virtual-time-s": 1.0 + partition,
            PARTITION_ID: partition,
        }
    )
    return Message(RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: metrics}), reply_to=msg)


@secagg_app.query()
def query(msg: Message, context: Context) -> Message:
    metrics = MetricRecord({PARTITION_ID: _partition_id(context)})
    return Message(RecordDict({METRICS_KEY: metrics}), reply_to=msg)


def _hang_until_killed(context: Context, partition: int) -> None:
    """Say so in the signal directory, then wait to be SIGKILLed (with the SuperNode)."""
    directory = context.node_config.get(SIGNAL_DIR)
    if not isinstance(directory, str) or not directory:
        raise ValueError(
            f"drop-stage '{SILENT}' needs node_config['{SIGNAL_DIR}'] (a directory the "
            "harness watches): it is for SuperNodes started by fedge.bench.secagg_silent"
        )
    Path(directory, f"{SILENT}-{partition}").write_text(str(os.getpid()))
    time.sleep(SILENT_HANG_S)
    raise PartyKilledError(f"partition {partition} was told to die silently, and was not killed")


def _partition_id(context: Context) -> int:
    value = context.node_config.get(PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"node_config['{PARTITION_ID}'] must be an int, got {value!r}")
    return value

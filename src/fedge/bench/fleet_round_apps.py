"""The peer of ``fedge bench fleet-round``: plain Flower on the same stations' data.

A plain ``ServerApp`` running Flower's own ``FedAvg.start`` (train and evaluate every
node every round) and a plain ``ClientApp`` doing exactly the station's ClientApp work
(:func:`fedge.party.station_app.train_round` / ``evaluate_round`` on the station's
kept images), started by plain ``flower-supernode`` processes. What differs from fedge's
side is only what fedge adds around that work: the agent supervising the SuperNode,
node identification, fedge's strategy loop, per-round run store records and checkpoints.

Polling is made equal (issue 25, item 4): Flower's deployment grid sleeps 3 s between
pulls of replies, fedge's collect loop backs off to :data:`POLL_S`. Up to 3 s per
round of waiting would otherwise count against Flower, so Flower's ``FedAvg.start`` gets
a grid that pulls every :data:`POLL_S` (:class:`PollingGrid`); the JSON says so.

Run config: ``initial`` (weights .npz), ``model-spec`` (JSON), ``rounds``, ``nodes``,
``lr``, ``local-epochs``, ``batch-size``, ``out`` (where the server writes its timing).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.run import Run

from fedge.aggregator.rounds.replies import to_array_record
from fedge.party.station_app import Station, evaluate_round, train_round
from fedge.protocols.model_spec import MODEL_SPEC_KEY, ModelSpec

server = ServerApp()
client = ClientApp()

POLL_S = 0.01
"""How often both sides pull replies: fedge's ceiling (``StreamingFedAvg.pull_interval_s``)."""


class PollingGrid(Grid):
    """Flower's grid, with ``send_and_receive`` pulling every ``poll_s`` instead of 3 s.

    Everything else is the wrapped grid's; the loop is Flower's own, only the sleep differs.
    """

    def __init__(self, grid: Grid, poll_s: float = POLL_S) -> None:
        self._grid = grid
        self.poll_s = poll_s

    @property
    def run(self) -> Run:
        return self._grid.run

    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        pending = set(self.push_messages(messages))
        end = time.time() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while timeout is None or time.time() < end:
            pulled = list(self.pull_messages(pending))
            replies += pulled
            pending -= {m.metadata.reply_to_message_id for m in pulled}
            if not pending:
                break
            time.sleep(self.poll_s)
        return replies


@server.main()
def main(grid: Grid, context: Context) -> None:
    out = Path(str(context.run_config["out"]))
    try:
        _serve(grid, context, out)
    except BaseException as exc:  # the benchmark waits on the file: tell it why
        out.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise


def _serve(grid: Grid, context: Context, out: Path) -> None:
    config = context.run_config
    nodes = int(config["nodes"])
    end = time.monotonic() + 300
    while len(list(grid.get_node_ids())) < nodes and time.monotonic() < end:
        time.sleep(0.5)
    with np.load(str(config["initial"]), allow_pickle=False) as npz:
        arrays = to_array_record({k: npz[k] for k in npz.files})
    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=1.0,
        min_train_nodes=nodes,
        min_evaluate_nodes=nodes,
        min_available_nodes=nodes,
    )
    spec = str(config[MODEL_SPEC_KEY])
    started = time.monotonic()
    result = strategy.start(
        PollingGrid(grid),
        arrays,
        num_rounds=int(config["rounds"]),
        train_config=ConfigRecord(
            {
                MODEL_SPEC_KEY: spec,
                "lr": float(config["lr"]),
                "local-epochs": int(config["local-epochs"]),
                "batch-size": int(config["batch-size"]),
            }
        ),
        evaluate_config=ConfigRecord({MODEL_SPEC_KEY: spec}),
    )
    seconds = time.monotonic() - started
    evaluations = {str(r): dict(m) for r, m in result.evaluate_metrics_clientapp.items()}
    out.write_text(
        json.dumps({"seconds": seconds, "rounds": int(config["rounds"]), "evaluate": evaluations})
    )


@client.train()
def train(msg: Message, context: Context) -> Message:
    station = Station.from_node_config(context.node_config)
    config = msg.content.config_records["config"]
    spec = ModelSpec.from_json(config.get(MODEL_SPEC_KEY))
    arrays, metrics = train_round(station, spec, msg.content.array_records["arrays"], config)
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord(dict(metrics))})
    return Message(content=content, reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    station = Station.from_node_config(context.node_config)
    spec = ModelSpec.from_json(msg.content.config_records["config"].get(MODEL_SPEC_KEY))
    metrics = evaluate_round(station, spec, msg.content.array_records["arrays"])
    return Message(content=RecordDict({"metrics": MetricRecord(dict(metrics))}), reply_to=msg)

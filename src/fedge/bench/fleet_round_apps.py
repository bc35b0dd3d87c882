"""The peer of ``fedge bench fleet-round``: plain Flower on the same stations' data.

A plain ``ServerApp`` running Flower's own ``FedAvg.start`` (train and evaluate every
node every round) and a plain ``ClientApp`` doing exactly the station's ClientApp work
(:func:`fedge.party.station_app.train_round` / ``evaluate_round`` on the station's
kept images), started by plain ``flower-supernode`` processes. What differs from fedge's
side is only what fedge adds around that work: the agent supervising the SuperNode,
node identification, fedge's strategy loop, per-round run store records and checkpoints.

Run config: ``initial`` (weights .npz), ``model-spec`` (JSON), ``rounds``, ``nodes``,
``lr``, ``local-epochs``, ``batch-size``, ``out`` (where the server writes its timing).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedge.aggregator.rounds.replies import to_array_record
from fedge.party.station_app import Station, evaluate_round, train_round
from fedge.protocols.model_spec import MODEL_SPEC_KEY, ModelSpec

server = ServerApp()
client = ClientApp()


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
        grid,
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

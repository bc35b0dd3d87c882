"""The station's Flower ``ClientApp``: train the job's model on this station's labelled images.

The agent (``fedge agent run`` with training enabled in its signed config) supervises a
``flower-supernode`` for the station; the SuperNode runs this app in its own process for
every message, so training never shares a process with inference. The node config the
agent starts the SuperNode with says where the station's data is::

    edge             the station's edge id (answers the aggregator's QUERY)
    data-dir         the agent's data directory (its kept images and labels)
    holdout-percent  the station's held-out share (as the agent keeps it)
    threads          CPU threads training may use
    max-seconds      the longest one round's training may take

A train message carries the global model (``"arrays"``) and a ``"config"`` record:
``model-spec`` (JSON: ``family``, ``params``, ``classes``, ``preprocess``), ``lr``,
``local-epochs``, ``batch-size``, ``server-round``. The reply's ``"metrics"``:

=======================  =================================================================
``num-examples``          labelled training images used (FedAvg's weight)
``train-loss``            mean cross-entropy over local training
``train-time-s``          wall time of local training
``local-acc``             the RECEIVED model's accuracy on the station's held-out images,
                          before training (TiFL's per-tier accuracy signal)
``holdout-acc-after``     the trained model's accuracy on the same held-out images
``holdout-examples``      held-out images
``skipped-unreadable``    kept files that no longer decode (skipped)
``skipped-unknown-label`` labels the model has no class for (skipped)
``stopped-early``         1 when the round's time cap ended training
=======================  =================================================================

An evaluate message gets ``eval-acc`` and ``num-examples`` on the held-out images; a
query gets ``{"edge": ...}`` in the ``"identity"`` config record. Anything that prevents
training (no labelled images, a family the station cannot build, weights that do not
fit) raises a :class:`~fedge.party.errors.PartyError`: Flower turns it into an error
reply, which the aggregator records as the party's failure -- data, never a hang.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge.party import families, trainer
from fedge.party.dataset import Retention, StationData
from fedge.party.errors import PartyError
from fedge.party.messages import ARRAYS_KEY, METRICS_KEY, global_arrays, round_config
from fedge.protocols.errors import ProtocolError
from fedge.protocols.model_spec import MODEL_SPEC_KEY, ModelSpec

IDENTITY_KEY = "identity"


@dataclass(frozen=True)
class Station:
    """Who this node is and where its data is (from the SuperNode's node config)."""

    edge: str
    data_dir: Path
    holdout_percent: int
    threads: int
    max_seconds: float

    @classmethod
    def from_node_config(cls, config: Mapping[str, Any]) -> Station:
        edge = config.get("edge")
        data_dir = config.get("data-dir")
        if not isinstance(edge, str) or not edge:
            raise PartyError("node_config['edge'] must name the station's edge")
        if not isinstance(data_dir, str) or not data_dir:
            raise PartyError("node_config['data-dir'] must be the agent's data directory")
        return cls(
            edge=edge,
            data_dir=Path(data_dir),
            holdout_percent=int(config.get("holdout-percent", 20)),
            threads=max(1, int(config.get("threads", 1))),
            max_seconds=float(config.get("max-seconds", 600.0)),
        )

    def data(self) -> StationData:
        return StationData(
            self.data_dir, Retention(holdout_percent=self.holdout_percent), readonly=True
        )


# ---------------------------------------------------------------- the work itself


def train_round(
    station: Station, spec: ModelSpec, arrays: ArrayRecord, config: ConfigRecord
) -> tuple[ArrayRecord, dict[str, int | float]]:
    """Train the received model on the station's labelled images; returns arrays, metrics."""
    family = families.get_family(spec.family)
    model = families.build(spec.family, spec.params, len(spec.classes))
    families.load_state_arrays(model, {k: v.numpy() for k, v in arrays.items()})
    train_items, held_items = _items(station)
    train_set = trainer.load_examples(train_items, spec.classes, spec.preprocess)
    held_out = trainer.load_examples(held_items, spec.classes, spec.preprocess)
    if len(train_set) == 0:
        raise PartyError(
            f"station {station.edge} has no usable labelled training images "
            f"({len(train_items)} labelled, skipped {dict(train_set.skipped)})"
        )
    # TiFL's signal is the received model on data it did not train on: without held-out
    # images there is none to give, and local-acc is left out of the reply.
    before = trainer.accuracy(model, held_out) if len(held_out) else float("nan")
    settings = trainer.TrainSettings(
        lr=_number(config, "lr", 3e-3),
        epochs=int(_number(config, "local-epochs", 2, minimum=1)),
        batch_size=int(_number(config, "batch-size", 32, minimum=1)),
        max_seconds=station.max_seconds,
        threads=station.threads,
        seed=int(_number(config, "server-round", 0)),
        augment_symmetries=family.augment_symmetries,
    )
    result = trainer.train(model, train_set, settings)
    after = trainer.accuracy(model, held_out) if len(held_out) else float("nan")
    skipped = train_set.skipped + held_out.skipped
    metrics: dict[str, int | float] = {
        "num-examples": len(train_set),
        "train-loss": result.loss if math.isfinite(result.loss) else 0.0,
        "train-time-s": result.seconds,
        "holdout-examples": len(held_out),
        "skipped-unreadable": skipped["unreadable_image"],
        "skipped-unknown-label": skipped["unknown_label"],
        "stopped-early": int(result.stopped_early),
    }
    if math.isfinite(before):
        metrics["local-acc"] = before
    if math.isfinite(after):
        metrics["holdout-acc-after"] = after
    return ArrayRecord(model.state_dict()), metrics


def evaluate_round(
    station: Station, spec: ModelSpec, arrays: ArrayRecord
) -> dict[str, int | float]:
    """Accuracy of the received model on the station's held-out images."""
    model = families.build(spec.family, spec.params, len(spec.classes))
    families.load_state_arrays(model, {k: v.numpy() for k, v in arrays.items()})
    _, held_items = _items(station)
    held_out = trainer.load_examples(held_items, spec.classes, spec.preprocess)
    if len(held_out) == 0:
        raise PartyError(f"station {station.edge} has no usable held-out images to evaluate on")
    return {"eval-acc": trainer.accuracy(model, held_out), "num-examples": len(held_out)}


def _items(station: Station) -> tuple[list[Any], list[Any]]:
    data = station.data()
    try:
        return trainer.split(data.labelled())
    finally:
        data.close()


# ---------------------------------------------------------------- the Flower adapter

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the job's model on this station's labelled images."""
    station = Station.from_node_config(context.node_config)
    config = round_config(msg)
    spec = model_spec(config)
    arrays, metrics = train_round(station, spec, global_arrays(msg), config)
    content = RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: MetricRecord(dict(metrics))})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The received model's accuracy on this station's held-out images."""
    station = Station.from_node_config(context.node_config)
    spec = model_spec(round_config(msg))
    metrics = evaluate_round(station, spec, global_arrays(msg))
    return Message(content=RecordDict({METRICS_KEY: MetricRecord(dict(metrics))}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Say which station this node is, and how much it could train on."""
    station = Station.from_node_config(context.node_config)
    try:
        train_items, held_items = _items(station)
    except PartyError:
        train_items, held_items = [], []
    content = RecordDict(
        {
            IDENTITY_KEY: ConfigRecord({"edge": station.edge}),
            METRICS_KEY: MetricRecord(
                {"labelled": len(train_items), "holdout-examples": len(held_items)}
            ),
        }
    )
    return Message(content=content, reply_to=msg)


def model_spec(config: ConfigRecord) -> ModelSpec:
    """The round's model spec; a PartyError (an error reply) when it is missing or bad."""
    try:
        return ModelSpec.from_json(config.get(MODEL_SPEC_KEY))
    except ProtocolError as exc:
        raise PartyError(str(exc)) from exc


def _number(config: ConfigRecord, key: str, default: float, *, minimum: float = 0.0) -> float:
    value = config.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < minimum
    ):
        raise PartyError(f"config[{key!r}] must be a number >= {minimum:g}, got {value!r}")
    return float(value)

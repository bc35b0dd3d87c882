"""The party side of a simulated federated round: a Flower ``ClientApp``.

Each party is one partition of a scenario (``fedge.sim.scenario``). It reads

* ``context.node_config["partition-id"]`` (and ``"num-partitions"``, checked against
  ``fleet.parties``),
* ``context.run_config["scenario"]`` (a shipped name or a path) and ``["seed"]`` (int),
* from the message: an ArrayRecord (the global model) and a ConfigRecord with optional
  ``arch``, ``lr``, ``local-epochs``, ``batch-size``, ``proximal-mu`` (defaults from the
  scenario's ``[training]``) and ``server-round`` (Flower's strategies inject it).

A train reply carries ``"arrays"`` (the trained model) and ``"metrics"``:

==================  =========================================================================
``num-examples``    local training examples (int; FedAvg's weight)
``train-loss``      mean cross-entropy over local training
``train-time-s``    real wall time of local training in this process
``virtual-time-s``  what the round would take on the party's device (``fedge.sim.profiles``)
``local-acc``       accuracy of the RECEIVED global model on the party's local validation
                    split, measured before training: TiFL's per-tier accuracy signal
                    (Chai et al. 2020, Algorithm 2)
``partition-id``    which party answered (int)
==================  =========================================================================

A simulated party is a station whose data set is generated: it trains, evaluates and
trains privately through the stations' own trainer (:mod:`fedge.party.trainer`), with
local SGD as the scenarios' ``lr`` is meant for. With ``dp-mode = "local"`` in the round
config the party trains with DP-SGD instead (:func:`fedge.party.trainer.train_private`:
plain SGD steps become Opacus' clipped and noised ones), checks and records each round
in its ledger under ``run_config["privacy-dir"]``, refuses a round past its budget
(``BudgetExhaustedError``, an error reply), and adds
``dp-epsilon-round``, ``dp-epsilon-job``, ``dp-epsilon-total``, ``dp-noise-multiplier``,
``dp-sample-rate`` and ``dp-steps`` to its metrics.

The compute part of ``virtual-time-s`` scales with the trained arch's parameter count
relative to ``"mlp"`` (``device.seconds_per_example`` is for ``"mlp"``).

An evaluate reply carries ``"metrics"`` with ``eval-loss``, ``eval-acc`` and
``num-examples`` on the party's local validation split. A query reply carries
``"metrics"`` with ``partition-id``: which party a node is (Flower's runtimes give nodes
random ids). The optional node config key ``delay-s`` makes a deployed party sleep that
many real seconds before its train reply (a test knob for slow parties).

A party that is switched off this round, or that drops out mid-way, raises
:class:`~fedge.sim.profiles.PartyUnavailableError` /
:class:`~fedge.sim.profiles.PartyDroppedOutError` before training. Flower's runtime turns
the exception into an error reply (``ErrorCode.CLIENT_APP_RAISED_EXCEPTION``, reason
``"<class '...PartyDroppedOutError'>:<'...'>"``): failures are data, and the strategy
splits them from valid replies. Evaluation is a measurement, not part of the simulated
device timeline, so it always answers.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import numpy as np
from flwr.app import (
    ArrayRecord,
    Context,
    Message,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.clientapp import ClientApp
from torch import nn

from fedge.models.digits import (
    count_parameters,
    load_arrays,
    make_model,
    model_bytes,
    to_arrays,
)
from fedge.party import trainer
from fedge.party.messages import ARRAYS_KEY, METRICS_KEY, global_arrays
from fedge.party.secagg import secagg_mod
from fedge.privacy.settings import PrivacyMode
from fedge.sim.party_inputs import (
    PRIVACY_DIR_KEY,
    Party,
    PartyConfigError,
    RoundSettings,
    as_float,
    as_int,
    party_from_context,
    round_settings,
)
from fedge.sim.profiles import (
    PartyDroppedOutError,
    PartyUnavailableError,
    drops_out,
    is_available,
    round_rng,
    virtual_round_time,
)

TRAIN_METRICS = (
    "num-examples",
    "train-loss",
    "train-time-s",
    "virtual-time-s",
    "local-acc",
    "partition-id",
)
EVALUATE_METRICS = ("eval-loss", "eval-acc", "num-examples")
PARTITION_ID_KEY = "partition-id"
DELAY_KEY = "delay-s"

_TRAIN_SEED_STREAM = 7


# ---------------------------------------------------------------- the work itself


def train_party(
    party: Party, arrays: ArrayRecord, settings: RoundSettings
) -> tuple[ArrayRecord, dict[str, int | float]]:
    """One party's round: refuse if simulated as down, else train; returns arrays, metrics."""
    pid, round_ = party.partition_id, settings.server_round
    if not is_available(party.profile, party.seed, pid, round_):
        raise PartyUnavailableError(
            f"partition {pid} is unavailable in round {round_} "
            f"(simulated: device.availability = {party.profile.availability})"
        )
    model = make_model(settings.arch, party.seed)
    load_arrays(model, arrays)
    _, y = party.train_data
    virtual_s = virtual_round_time(
        party.profile,
        n_examples=len(y),
        epochs=settings.local_epochs,
        model_bytes=model_bytes(model),
        # device.seconds_per_example is for the reference "mlp"; compute scales with the
        # parameter count (an MLP's FLOPs per example), so a smaller arch costs less.
        seconds_per_example=party.scenario.device.seconds_per_example
        * count_parameters(model)
        / _reference_parameters(),
        rng=round_rng(party.seed, pid, round_),
    )
    if drops_out(party.profile, party.seed, pid, round_):
        raise PartyDroppedOutError(
            f"partition {pid} dropped out mid-way through round {round_} "
            f"(simulated: device.dropout = {party.profile.dropout}); "
            f"virtual-time-s={virtual_s:.6g} for the full round"
        )

    train_set = trainer.Examples(*party.train_data)
    held_out = trainer.Examples(*party.validation_data)
    # TiFL's A_t: the received global model on the party's own held-out data. A party too
    # small to hold validation data is measured on its training data instead.
    local_acc = trainer.accuracy(model, held_out if len(held_out) else train_set)
    train_settings = trainer.TrainSettings(
        lr=settings.lr,
        epochs=settings.local_epochs,
        batch_size=settings.batch_size,
        max_seconds=None,  # the party's time is virtual-time-s, not a wall-clock cap
        threads=None,  # parties share the simulator's process: its thread count stays
        seed=_train_seed(party.seed, pid, round_),
        optimizer="sgd",  # FedAvg's local SGD, as the scenarios' lr is for
        proximal_mu=settings.proximal_mu,
    )
    if settings.privacy.mode is PrivacyMode.LOCAL:
        result = _train_private(party, model, train_set, train_settings, settings)
    else:
        result = trainer.train(model, train_set, train_settings)
    metrics: dict[str, int | float] = {
        "num-examples": len(train_set),
        "train-loss": result.loss,
        "train-time-s": result.seconds,
        "virtual-time-s": virtual_s,
        "local-acc": local_acc,
        "partition-id": pid,
        **result.dp_metrics,
    }
    return to_arrays(model), metrics


def _train_private(
    party: Party,
    model: nn.Module,
    examples: trainer.Examples,
    train_settings: trainer.TrainSettings,
    settings: RoundSettings,
) -> trainer.TrainResult:
    """DP-SGD on the party's data through the stations' trainer, its ledger in the run's
    privacy directory (one thread: Opacus' per-example gradients beside other parties)."""
    if not party.privacy_dir:
        raise PartyConfigError(
            f"DP-SGD needs run_config[{PRIVACY_DIR_KEY!r}]: where party ledgers are kept"
        )
    return trainer.train_private(
        model,
        examples,
        dataclasses.replace(train_settings, threads=1),
        settings.privacy,
        ledger_path=Path(party.privacy_dir) / f"party-{party.partition_id}.db",
        job=settings.job or "sim",
        server_round=settings.server_round,
    )


def evaluate_party(
    party: Party, arrays: ArrayRecord, settings: RoundSettings
) -> dict[str, int | float]:
    """Loss and accuracy of the received model on the party's local validation split
    (0 and 0 for a party without one)."""
    model = make_model(settings.arch, party.seed)
    load_arrays(model, arrays)
    held_out = trainer.Examples(*party.validation_data)
    if len(held_out) == 0:
        return {"eval-loss": 0.0, "eval-acc": 0.0, "num-examples": 0}
    loss, acc = trainer.evaluate(model, held_out)
    return {"eval-loss": loss, "eval-acc": acc, "num-examples": len(held_out)}


# ---------------------------------------------------------------- the Flower adapter

# SecAgg+ rounds reach the app through Flower's secaggplus_mod (fedge.party.secagg).
app = ClientApp(mods=[secagg_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on this party's partition (or fail as simulated)."""
    party = party_from_context(context)
    settings = round_settings(msg, party.scenario)
    arrays, metrics = train_party(party, global_arrays(msg), settings)
    delay_s = _deployment_delay_s(context)
    if delay_s:
        time.sleep(delay_s)  # a deliberately slow party (deployment tests only)
    content = RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: _metric_record(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this party's local validation split."""
    party = party_from_context(context)
    settings = round_settings(msg, party.scenario)
    metrics = evaluate_party(party, global_arrays(msg), settings)
    return Message(content=RecordDict({METRICS_KEY: _metric_record(metrics)}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Say which party this node is: ``{"partition-id": ...}`` from its node config.

    A Grid whose node ids carry no meaning (Flower's runtimes draw them at random) asks
    every node once and orders the fleet by partition id (``PartitionOrderedGrid``).
    """
    partition_id = as_int(
        context.node_config.get("partition-id"), "node_config['partition-id']", minimum=0
    )
    content = RecordDict({METRICS_KEY: MetricRecord({PARTITION_ID_KEY: partition_id})})
    return Message(content=content, reply_to=msg)


# ---------------------------------------------------------------- helpers


def _deployment_delay_s(context: Context) -> float:
    """``node_config["delay-s"]``: real seconds a party sleeps before replying to train.

    A deployment-only knob for tests of slow parties (a SuperNode started with
    ``--node-config "... delay-s=30"``); simulated slowness is ``virtual-time-s``.
    """
    if DELAY_KEY not in context.node_config:
        return 0.0
    return as_float(context.node_config[DELAY_KEY], f"node_config['{DELAY_KEY}']", zero_ok=True)


REFERENCE_ARCH = "mlp"


@functools.cache
def _reference_parameters() -> int:
    """Parameters of :data:`REFERENCE_ARCH`, the arch ``seconds_per_example`` is for."""
    return count_parameters(make_model(REFERENCE_ARCH))


def _metric_record(metrics: dict[str, int | float]) -> MetricRecord:
    values: dict[str, MetricRecordValues] = dict(metrics)
    return MetricRecord(values)


def _train_seed(seed: int, partition_id: int, server_round: int) -> int:
    rng = np.random.default_rng([seed, partition_id, server_round, _TRAIN_SEED_STREAM])
    return int(rng.integers(2**31))

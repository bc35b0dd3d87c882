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

import functools
import time
from dataclasses import dataclass, field
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
    accuracy,
    count_parameters,
    evaluate,
    load_arrays,
    make_model,
    model_bytes,
    to_arrays,
    train_local,
)
from fedge.party import private_round
from fedge.party.errors import PartyError
from fedge.party.messages import ARRAYS_KEY, METRICS_KEY, global_arrays, round_config
from fedge.party.secagg import secagg_mod
from fedge.privacy.settings import PrivacyError, PrivacyMode, PrivacySpec
from fedge.sim.data import Partitions, Split, make_partitions
from fedge.sim.profiles import (
    DeviceProfile,
    PartyDroppedOutError,
    PartyUnavailableError,
    drops_out,
    is_available,
    profiles_for,
    round_rng,
    virtual_round_time,
)
from fedge.sim.scenario import Scenario, load_scenario

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
PRIVACY_DIR_KEY = "privacy-dir"
"""run_config key: where each party keeps its DP-SGD ledger (``party-<id>.db``)."""

_TRAIN_SEED_STREAM = 7


class PartyConfigError(PartyError):
    """The run config, node config or round config given to a party is unusable."""


# ---------------------------------------------------------------- typed inputs


@dataclass(frozen=True)
class Party:
    """One party of one run: its scenario, seed, data and device."""

    scenario: Scenario
    seed: int
    partition_id: int
    partitions: Partitions
    profile: DeviceProfile
    privacy_dir: str = ""

    @property
    def train_data(self) -> Split:
        return self.partitions.parties[self.partition_id]

    @property
    def validation_data(self) -> Split:
        return self.partitions.validation[self.partition_id]


@dataclass(frozen=True)
class RoundSettings:
    """What one round asks of a party (the round config over the scenario's defaults)."""

    server_round: int
    arch: str
    lr: float
    local_epochs: int
    batch_size: int
    proximal_mu: float
    privacy: PrivacySpec = field(default_factory=PrivacySpec)
    job: str = ""


def party_from_context(context: Context) -> Party:
    """Resolve the party a Flower ``Context`` describes (scenario and data are cached)."""
    scenario_ref = context.run_config.get("scenario")
    if not isinstance(scenario_ref, str) or not scenario_ref:
        raise PartyConfigError(
            f"run_config['scenario'] must name a scenario or a path to one, got {scenario_ref!r}"
        )
    seed = _as_int(context.run_config.get("seed"), "run_config['seed']", minimum=0)
    partition_id = _as_int(
        context.node_config.get("partition-id"), "node_config['partition-id']", minimum=0
    )
    scenario = _scenario(scenario_ref)
    parties = scenario.fleet.parties
    if "num-partitions" in context.node_config:
        declared = _as_int(
            context.node_config["num-partitions"], "node_config['num-partitions']", minimum=1
        )
        if declared != parties:
            raise PartyConfigError(
                f"node_config['num-partitions'] is {declared} but scenario "
                f"{scenario.name!r} has fleet.parties = {parties}; start the simulation "
                f"with {parties} supernodes"
            )
    if partition_id >= parties:
        raise PartyConfigError(
            f"node_config['partition-id'] must be < fleet.parties ({parties}), got {partition_id}"
        )
    return Party(
        scenario=scenario,
        seed=seed,
        partition_id=partition_id,
        partitions=make_partitions(scenario, seed),
        profile=profiles_for(scenario, seed)[partition_id],
        privacy_dir=str(context.run_config.get(PRIVACY_DIR_KEY, "")),
    )


def round_settings(message: Message, scenario: Scenario) -> RoundSettings:
    """The round's settings: ``config`` values where given, the scenario's otherwise."""
    config = round_config(message)
    defaults = scenario.training
    server_round = config.get("server-round")
    if server_round is None and message.metadata.group_id.isdigit():
        server_round = int(message.metadata.group_id)
    arch = config.get("arch", defaults.arch)
    if not isinstance(arch, str) or not arch:
        raise PartyConfigError(f"config['arch'] must be a non-empty string, got {arch!r}")
    try:
        privacy = PrivacySpec.from_config(config)
    except PrivacyError as exc:
        raise PartyConfigError(str(exc)) from exc
    return RoundSettings(
        privacy=privacy,
        job=str(config.get("job-id", "")),
        server_round=_as_int(server_round, "config['server-round']", minimum=0),
        arch=arch,
        lr=_as_float(config.get("lr", defaults.lr), "config['lr']"),
        local_epochs=_as_int(
            config.get("local-epochs", defaults.local_epochs), "config['local-epochs']", minimum=1
        ),
        batch_size=_as_int(
            config.get("batch-size", defaults.batch_size), "config['batch-size']", minimum=1
        ),
        proximal_mu=_as_float(
            config.get("proximal-mu", defaults.proximal_mu), "config['proximal-mu']", zero_ok=True
        ),
    )


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
    X, y = party.train_data
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

    X_val, y_val = party.validation_data
    # TiFL's A_t: the received global model on the party's own held-out data. A party too
    # small to hold validation data is measured on its training data instead.
    local_acc = accuracy(model, X_val, y_val) if len(y_val) else accuracy(model, X, y)

    if settings.privacy.mode is PrivacyMode.LOCAL:
        private = _train_private(party, model, settings)
        metrics: dict[str, int | float] = {
            "num-examples": len(y),
            "train-loss": private.loss,
            "train-time-s": private.seconds,
            "virtual-time-s": virtual_s,
            "local-acc": local_acc,
            "partition-id": pid,
            **private.metrics(),
        }
        return to_arrays(model), metrics
    started = time.perf_counter()
    loss = train_local(
        model,
        X,
        y,
        epochs=settings.local_epochs,
        lr=settings.lr,
        batch_size=settings.batch_size,
        proximal_mu=settings.proximal_mu,
        seed=_train_seed(party.seed, pid, round_),
    )
    wall_s = time.perf_counter() - started
    metrics = {
        "num-examples": len(y),
        "train-loss": loss,
        "train-time-s": wall_s,
        "virtual-time-s": virtual_s,
        "local-acc": local_acc,
        "partition-id": pid,
    }
    return to_arrays(model), metrics


def _train_private(
    party: Party, model: nn.Module, settings: RoundSettings
) -> private_round.PrivateRound:
    """DP-SGD on the party's data, its ledger in the run's privacy directory."""
    if not party.privacy_dir:
        raise PartyConfigError(
            f"DP-SGD needs run_config[{PRIVACY_DIR_KEY!r}]: where party ledgers are kept"
        )
    if settings.proximal_mu > 0:
        raise PartyConfigError("DP-SGD cannot train with FedProx's proximal term")
    X, y = party.train_data
    return private_round.train_round(
        model,
        X,
        y,
        spec=settings.privacy,
        ledger_path=Path(party.privacy_dir) / f"party-{party.partition_id}.db",
        job=settings.job or "sim",
        server_round=settings.server_round,
        epochs=settings.local_epochs,
        lr=settings.lr,
        batch_size=settings.batch_size,
        seed=_train_seed(party.seed, party.partition_id, settings.server_round),
        threads=1,
    )


def evaluate_party(
    party: Party, arrays: ArrayRecord, settings: RoundSettings
) -> dict[str, int | float]:
    """Loss and accuracy of the received model on the party's local validation split."""
    model = make_model(settings.arch, party.seed)
    load_arrays(model, arrays)
    X_val, y_val = party.validation_data
    loss, acc = evaluate(model, X_val, y_val)
    return {"eval-loss": loss, "eval-acc": acc, "num-examples": len(y_val)}


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
    partition_id = _as_int(
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
    return _as_float(context.node_config[DELAY_KEY], f"node_config['{DELAY_KEY}']", zero_ok=True)


REFERENCE_ARCH = "mlp"


@functools.cache
def _reference_parameters() -> int:
    """Parameters of :data:`REFERENCE_ARCH`, the arch ``seconds_per_example`` is for."""
    return count_parameters(make_model(REFERENCE_ARCH))


@functools.lru_cache(maxsize=8)
def _scenario(name_or_path: str) -> Scenario:
    return load_scenario(name_or_path)


def _metric_record(metrics: dict[str, int | float]) -> MetricRecord:
    values: dict[str, MetricRecordValues] = dict(metrics)
    return MetricRecord(values)


def _train_seed(seed: int, partition_id: int, server_round: int) -> int:
    rng = np.random.default_rng([seed, partition_id, server_round, _TRAIN_SEED_STREAM])
    return int(rng.integers(2**31))


def _as_int(value: object, name: str, *, minimum: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PartyConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise PartyConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _as_float(value: object, name: str, *, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PartyConfigError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not np.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise PartyConfigError(f"{name} must be {bound}, got {value!r}")
    return number

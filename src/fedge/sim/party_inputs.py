"""What a simulated party is and what a round asks of it, read from Flower's ``Context``
and ``Message`` and checked (:mod:`fedge.sim.party_app` runs the round).

A party is one partition of a scenario: ``context.node_config["partition-id"]`` (and
``"num-partitions"``, checked against ``fleet.parties``), ``context.run_config["scenario"]``
(a shipped name or a path), ``["seed"]`` and, for DP-SGD, ``["privacy-dir"]`` (where each
party keeps its budget ledger). The round's ``ConfigRecord`` may override the scenario's
training settings and carries the job's privacy settings (``dp-*``, ``job-id``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Context, Message

from fedge.datasets.tables import Partitions, Split
from fedge.party.errors import PartyError
from fedge.party.messages import round_config
from fedge.privacy.settings import PrivacyError, PrivacySpec
from fedge.sim.data import make_partitions
from fedge.sim.profiles import DeviceProfile, profiles_for
from fedge.sim.scenario import Scenario, ScenarioError, load_scenario

PRIVACY_DIR_KEY = "privacy-dir"
"""run_config key: where each party keeps its DP-SGD ledger (``party-<id>.db``)."""
PARTIES_KEY = "fleet-parties"
"""run_config key: the fleet's size as run, when ``fedge sim --parties`` resized it."""


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
    seed = as_int(context.run_config.get("seed"), "run_config['seed']", minimum=0)
    partition_id = as_int(
        context.node_config.get("partition-id"), "node_config['partition-id']", minimum=0
    )
    scenario = _scenario(scenario_ref)
    if PARTIES_KEY in context.run_config:
        resized = as_int(context.run_config[PARTIES_KEY], f"run_config[{PARTIES_KEY!r}]", minimum=1)
        scenario = _resized(scenario_ref, resized)
    parties = scenario.fleet.parties
    if "num-partitions" in context.node_config:
        declared = as_int(
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
        server_round=as_int(server_round, "config['server-round']", minimum=0),
        arch=arch,
        lr=as_float(config.get("lr", defaults.lr), "config['lr']"),
        local_epochs=as_int(
            config.get("local-epochs", defaults.local_epochs), "config['local-epochs']", minimum=1
        ),
        batch_size=as_int(
            config.get("batch-size", defaults.batch_size), "config['batch-size']", minimum=1
        ),
        proximal_mu=as_float(
            config.get("proximal-mu", defaults.proximal_mu), "config['proximal-mu']", zero_ok=True
        ),
    )


@functools.lru_cache(maxsize=8)
def _scenario(name_or_path: str) -> Scenario:
    return load_scenario(name_or_path)


@functools.lru_cache(maxsize=8)
def _resized(name_or_path: str, parties: int) -> Scenario:
    try:
        return _scenario(name_or_path).with_parties(parties)
    except ScenarioError as exc:
        raise PartyConfigError(str(exc)) from exc


def as_int(value: object, name: str, *, minimum: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PartyConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise PartyConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def as_float(value: object, name: str, *, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PartyConfigError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not np.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise PartyConfigError(f"{name} must be {bound}, got {value!r}")
    return number

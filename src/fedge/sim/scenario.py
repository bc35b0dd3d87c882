"""Federated-learning scenarios: a heterogeneous fleet, its data and its training recipe.

A scenario is one TOML file, read once at the entry point and passed down as a frozen
:class:`Scenario`. A bare name (``"tifl-digits"``) resolves to the file shipped in
``fedge/sim/scenarios/<name>.toml``; anything with a ``/`` or a ``.toml`` suffix is a path.

The fleet follows TiFL's set-up (Chai et al., HPDC 2020, section 5.1; see
../shared/research/fl-algorithms.md section 1.2): equal-size groups of parties with relative
CPU shares (4/2/1/0.5/0.1, a 40:1 spread) that also differ in how much data they hold
(10/15/20/25/30 %). ``speed_distribution = "lognormal"`` swaps the groups for FedScale-style
per-party speeds drawn from LogNormal(0, ``lognormal_sigma``).

Every problem raises :class:`ScenarioError` naming the offending field by its dotted path
(``fleet.groups[2].cpus``), so a user can fix the file without reading this module.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fedge.datasets.tables import DATASETS
from fedge.sim.errors import SimError
from fedge.toml_table import TomlTable

SCENARIO_DIR = Path(__file__).parent / "scenarios"
"""Where the shipped scenarios live (installed as package data)."""
ROUNDS_KEY = "rounds"  # [strategies.<name>] rounds: that strategy's own number of rounds

SpeedDistribution = Literal["groups", "lognormal"]
_SHARE_TOLERANCE = 1e-6


class ScenarioError(SimError):
    """A scenario file is missing, malformed, or holds a value out of range."""


# ---------------------------------------------------------------- the typed scenario


@dataclass(frozen=True)
class DataSpec:
    """``[data]``: which dataset, how skewed, and which splits are held aside."""

    alpha: float
    """Dirichlet concentration of each party's label mix (small = skewed, large = IID)."""
    dataset: str = "digits"
    test_fraction: float = 0.2
    """Of the whole dataset: the stratified, held-out test set."""
    proxy_fraction: float = 0.1
    """Of what remains after the test split: unlabeled server-side data (FedDF-style KD)."""
    samples_per_party: int = 0
    """0: the parties split what is left, every sample used once. N > 0: fleet scale
    (issue 29) -- each party draws its data (N samples on average, sized by its group's
    ``data_share``) from that pool when it is first asked, with replacement, as stations
    of one plant see parts alike; nothing is kept for parties not being asked, so memory
    does not grow with the fleet (sim/data.py)."""

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ScenarioError(
                f"data.dataset must be one of {list(DATASETS)}, got {self.dataset!r}"
            )
        _positive(self.alpha, "data.alpha")
        if not (math.isfinite(self.test_fraction) and 0 < self.test_fraction < 1):
            raise ScenarioError(f"data.test_fraction must be in (0, 1), got {self.test_fraction}")
        if not (math.isfinite(self.proxy_fraction) and 0 <= self.proxy_fraction < 1):
            raise ScenarioError(f"data.proxy_fraction must be in [0, 1), got {self.proxy_fraction}")
        if isinstance(self.samples_per_party, bool) or not 0 <= self.samples_per_party <= 1_000_000:
            raise ScenarioError(
                f"data.samples_per_party must be 0 (split the dataset) or a count up to "
                f"1,000,000, got {self.samples_per_party!r}"
            )


@dataclass(frozen=True)
class GroupSpec:
    """One ``[[fleet.groups]]`` entry: ``count`` identical parties (validated by the fleet)."""

    count: int
    cpus: float
    """Relative compute: time per example is divided by this (TiFL: 4/2/1/0.5/0.1)."""
    data_share: float
    """Fraction of all party training data the whole group holds, split evenly inside it."""
    bandwidth_mbps: float | None = None
    """Overrides ``device.bandwidth_mbps`` for this group."""


@dataclass(frozen=True)
class FleetSpec:
    """``[fleet]``: how many parties, how many train per round, and how fast each one is."""

    parties: int
    per_round: int
    groups: tuple[GroupSpec, ...] = ()
    speed_distribution: SpeedDistribution = "groups"
    lognormal_sigma: float | None = None

    def __post_init__(self) -> None:
        _at_least(self.parties, 1, "fleet.parties")
        _at_least(self.per_round, 1, "fleet.per_round")
        if self.per_round > self.parties:
            raise ScenarioError(
                f"fleet.per_round must be <= fleet.parties ({self.parties}), got {self.per_round}"
            )
        if self.speed_distribution == "lognormal":
            if self.groups:
                raise ScenarioError(
                    "fleet.groups must be absent when fleet.speed_distribution = 'lognormal'"
                )
            if self.lognormal_sigma is None:
                raise ScenarioError(
                    "missing field fleet.lognormal_sigma "
                    "(required when fleet.speed_distribution = 'lognormal')"
                )
            _non_negative(self.lognormal_sigma, "fleet.lognormal_sigma")
            return
        if self.speed_distribution != "groups":
            raise ScenarioError(
                "fleet.speed_distribution must be 'groups' or 'lognormal', "
                f"got {self.speed_distribution!r}"
            )
        if self.lognormal_sigma is not None:
            raise ScenarioError(
                "fleet.lognormal_sigma only applies when fleet.speed_distribution = 'lognormal'"
            )
        if not self.groups:
            raise ScenarioError("missing field fleet.groups (at least one [[fleet.groups]] table)")
        for index, group in enumerate(self.groups):
            where = f"fleet.groups[{index}]"
            _at_least(group.count, 1, f"{where}.count")
            _positive(group.cpus, f"{where}.cpus")
            _fraction(group.data_share, f"{where}.data_share", allow_zero=False)
            if group.bandwidth_mbps is not None:
                _positive(group.bandwidth_mbps, f"{where}.bandwidth_mbps")
        counted = sum(group.count for group in self.groups)
        if counted != self.parties:
            raise ScenarioError(
                f"fleet.groups[*].count must sum to fleet.parties ({self.parties}), got {counted}"
            )
        shares = sum(group.data_share for group in self.groups)
        if abs(shares - 1.0) > _SHARE_TOLERANCE:
            raise ScenarioError(f"fleet.groups[*].data_share must sum to 1, got {shares:.6g}")

    def group_of(self, partition_id: int) -> int | None:
        """The group index of a partition (groups own consecutive ids), None for lognormal."""
        if not 0 <= partition_id < self.parties:
            raise ScenarioError(f"partition id must be in [0, {self.parties}), got {partition_id}")
        start = 0
        for index, group in enumerate(self.groups):
            start += group.count
            if partition_id < start:
                return index
        return None


@dataclass(frozen=True)
class DeviceSpec:
    """``[device]``: the per-party cost model behind the virtual clock."""

    seconds_per_example: float
    """Compute seconds per training example per epoch on 1 CPU."""
    bandwidth_mbps: float = 10.0
    jitter_sigma: float = 0.0
    """Per-round LogNormal(0, sigma) factor on compute time."""
    availability: float = 1.0
    """Probability that a party is up in a given round."""
    dropout: float = 0.0
    """Probability that a party that starts a round fails before replying."""

    def __post_init__(self) -> None:
        _positive(self.seconds_per_example, "device.seconds_per_example")
        _positive(self.bandwidth_mbps, "device.bandwidth_mbps")
        _non_negative(self.jitter_sigma, "device.jitter_sigma")
        _fraction(self.availability, "device.availability", allow_zero=False)
        _fraction(self.dropout, "device.dropout", allow_zero=True)
        if self.dropout >= 1.0:
            raise ScenarioError(f"device.dropout must be < 1, got {self.dropout}")


@dataclass(frozen=True)
class TrainingSpec:
    """``[training]``: the recipe every party uses unless a round's config overrides it."""

    rounds: int
    lr: float
    local_epochs: int
    batch_size: int
    target_accuracy: float
    arch: str = "mlp"
    proximal_mu: float = 0.0
    """FedProx mu (Li et al., MLSys 2020); 0 is plain FedAvg local training."""

    def __post_init__(self) -> None:
        _at_least(self.rounds, 1, "training.rounds")
        _positive(self.lr, "training.lr")
        _at_least(self.local_epochs, 1, "training.local_epochs")
        _at_least(self.batch_size, 1, "training.batch_size")
        _fraction(self.target_accuracy, "training.target_accuracy", allow_zero=False)
        if not self.arch:
            raise ScenarioError("training.arch must not be empty")
        _non_negative(self.proximal_mu, "training.proximal_mu")


@dataclass(frozen=True)
class Scenario:
    """A whole scenario. Hashable on everything but ``strategies`` and ``source``."""

    name: str
    data: DataSpec
    fleet: FleetSpec
    device: DeviceSpec
    training: TrainingSpec
    description: str = ""
    strategies: dict[str, dict[str, object]] = field(
        default_factory=dict, hash=False, compare=False
    )
    """``[strategies.<name>]`` tables, passed through as-is (the aggregator validates them)."""
    source: str = field(default="", compare=False)
    """The file this scenario was read from ("" when built in code)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ScenarioError("name must not be empty")

    def strategy(self, name: str) -> dict[str, object]:
        """The strategy parameters of ``[strategies.<name>]`` (without its ``rounds``)."""
        return {k: v for k, v in self._table(name).items() if k != ROUNDS_KEY}

    def rounds_for(self, name: str) -> int:
        """Rounds ``name`` runs: its table's ``rounds``, else ``training.rounds``.

        A strategy whose rounds are much cheaper in virtual time (small models on slow
        tiers) needs more of them to converge; accuracy "at convergence" compares each
        strategy at the end of its own run.
        """
        rounds = self._table(name).get(ROUNDS_KEY, self.training.rounds)
        assert isinstance(rounds, int)  # checked when the scenario was read
        return rounds

    def with_parties(self, parties: int) -> Scenario:
        """The same fleet at another size (``fedge sim --parties``, issue 29): a lognormal
        fleet draws more parties; a fleet of groups keeps each group's share of the
        parties (largest remainder, at least one each) and of the data. Parties per
        round stay as they are, capped at the fleet."""
        _at_least(parties, 1, "parties")
        fleet = self.fleet
        if parties == fleet.parties:
            return self
        groups = fleet.groups
        if groups:
            if parties < len(groups):
                raise ScenarioError(
                    f"--parties {parties} is fewer than the scenario's {len(groups)} "
                    "fleet.groups (each keeps at least one party)"
                )
            ideal = [group.count * parties / fleet.parties for group in groups]
            counts = [max(1, math.floor(value)) for value in ideal]
            order = sorted(range(len(groups)), key=lambda i: ideal[i] - math.floor(ideal[i]))
            while sum(counts) < parties:
                counts[order.pop()] += 1
            while sum(counts) > parties:  # the floors of one lifted a small group
                counts[max(range(len(counts)), key=counts.__getitem__)] -= 1
            groups = tuple(
                dataclasses.replace(group, count=count)
                for group, count in zip(groups, counts, strict=True)
            )
        resized = dataclasses.replace(
            fleet, parties=parties, per_round=min(fleet.per_round, parties), groups=groups
        )
        return dataclasses.replace(self, fleet=resized)

    def with_rounds(self, rounds: int) -> Scenario:
        """Every strategy runs ``rounds`` rounds (``fedge sim --rounds``)."""
        _at_least(rounds, 1, "rounds")
        return dataclasses.replace(
            self,
            training=dataclasses.replace(self.training, rounds=rounds),
            strategies={
                name: {k: v for k, v in table.items() if k != ROUNDS_KEY}
                for name, table in self.strategies.items()
            },
        )

    def _table(self, name: str) -> dict[str, object]:
        try:
            return self.strategies[name]
        except KeyError:
            known = ", ".join(sorted(self.strategies)) or "none"
            raise ScenarioError(
                f"scenario {self.name!r} has no [strategies.{name}] table (has: {known})"
            ) from None


# ---------------------------------------------------------------- loading


def scenario_path(name_or_path: str) -> Path:
    """Resolve a bare scenario name to its shipped file; anything path-like stays a path."""
    if "/" in name_or_path or "\\" in name_or_path or name_or_path.endswith(".toml"):
        return Path(name_or_path)
    return SCENARIO_DIR / f"{name_or_path}.toml"


def shipped_scenarios() -> tuple[str, ...]:
    """Names of the scenarios shipped with fedge."""
    return tuple(sorted(path.stem for path in SCENARIO_DIR.glob("*.toml")))


def load_scenario(name_or_path: str) -> Scenario:
    """Read and validate a scenario; raises :class:`ScenarioError` naming the bad field."""
    path = scenario_path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        shipped = ", ".join(shipped_scenarios())
        raise ScenarioError(
            f"no scenario {name_or_path!r}: {path} does not exist (shipped: {shipped})"
        ) from None
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc}") from exc
    return parse_scenario(text, source=str(path))


def parse_scenario(text: str, *, source: str = "") -> Scenario:
    """Validate scenario TOML text (``source`` only labels error messages)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario {source or '<text>'} is not valid TOML: {exc}") from exc
    top = TomlTable(document, "", _TOP_FIELDS, error=ScenarioError)
    data = top.table("data", _DATA_FIELDS)
    fleet = top.table("fleet", _FLEET_FIELDS)
    device = top.table("device", _DEVICE_FIELDS)
    training = top.table("training", _TRAINING_FIELDS)
    strategies = top.optional_table("strategies", None)

    distribution = fleet.text("speed_distribution", "groups")
    if distribution not in ("groups", "lognormal"):
        raise ScenarioError(
            f"fleet.speed_distribution must be 'groups' or 'lognormal', got {distribution!r}"
        )
    return Scenario(
        name=top.text("name"),
        description=top.text("description", ""),
        data=DataSpec(
            alpha=data.number("alpha"),
            dataset=data.text("dataset", "digits"),
            test_fraction=data.number("test_fraction", 0.2),
            proxy_fraction=data.number("proxy_fraction", 0.1),
            samples_per_party=data.integer("samples_per_party", minimum=0, default=0),
        ),
        fleet=FleetSpec(
            parties=fleet.integer("parties"),
            per_round=fleet.integer("per_round"),
            groups=tuple(_group(table) for table in fleet.tables("groups", _GROUP_FIELDS)),
            speed_distribution="groups" if distribution == "groups" else "lognormal",
            lognormal_sigma=fleet.optional_number("lognormal_sigma"),
        ),
        device=DeviceSpec(
            seconds_per_example=device.number("seconds_per_example"),
            bandwidth_mbps=device.number("bandwidth_mbps", 10.0),
            jitter_sigma=device.number("jitter_sigma", 0.0),
            availability=device.number("availability", 1.0),
            dropout=device.number("dropout", 0.0),
        ),
        training=TrainingSpec(
            rounds=training.integer("rounds"),
            lr=training.number("lr"),
            local_epochs=training.integer("local_epochs"),
            batch_size=training.integer("batch_size"),
            target_accuracy=training.number("target_accuracy"),
            arch=training.text("arch", "mlp"),
            proximal_mu=training.number("proximal_mu", 0.0),
        ),
        strategies=_strategies(strategies),
        source=source,
    )


_TOP_FIELDS = frozenset(
    ("name", "description", "data", "fleet", "device", "training", "strategies")
)
_DATA_FIELDS = frozenset(
    ("dataset", "alpha", "test_fraction", "proxy_fraction", "samples_per_party")
)
_FLEET_FIELDS = frozenset(
    ("parties", "per_round", "groups", "speed_distribution", "lognormal_sigma")
)
_GROUP_FIELDS = frozenset(("count", "cpus", "data_share", "bandwidth_mbps"))
_DEVICE_FIELDS = frozenset(
    ("seconds_per_example", "bandwidth_mbps", "jitter_sigma", "availability", "dropout")
)
_TRAINING_FIELDS = frozenset(
    ("rounds", "lr", "local_epochs", "batch_size", "target_accuracy", "arch", "proximal_mu")
)


def _group(table: TomlTable) -> GroupSpec:
    return GroupSpec(
        count=table.integer("count"),
        cpus=table.number("cpus"),
        data_share=table.number("data_share"),
        bandwidth_mbps=table.optional_number("bandwidth_mbps"),
    )


def _strategies(table: TomlTable | None) -> dict[str, dict[str, object]]:
    if table is None:
        return {}
    strategies = {name: dict(table.table(name, None).items()) for name in table.names()}
    for name, params in strategies.items():
        rounds = params.get(ROUNDS_KEY)
        if rounds is not None and (type(rounds) is not int or rounds < 1):
            raise ScenarioError(f"strategies.{name}.rounds must be an integer >= 1, got {rounds!r}")
    return strategies


# ---------------------------------------------------------------- range checks


def _positive(value: float, name: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ScenarioError(f"{name} must be > 0, got {value}")


def _non_negative(value: float, name: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ScenarioError(f"{name} must be >= 0, got {value}")


def _at_least(value: int, minimum: int, name: str) -> None:
    if value < minimum:
        raise ScenarioError(f"{name} must be >= {minimum}, got {value}")


def _fraction(value: float, name: str, *, allow_zero: bool) -> None:
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok and value <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ScenarioError(f"{name} must be in {interval}, got {value}")

"""The aggregator side of a deployed federation: a Flower ``ServerApp``.

``flwr run`` starts it on a SuperLink; it reads everything from its run config (flat keys,
as ``[tool.flwr.app.config]`` and ``flwr run --run-config`` give them):

=======================  ==================================================================
``strategy``             ``fedavg``, ``fedprox``, ``tiered`` or ``distill`` (:mod:`.factory`)
``scenario``             the scenario the parties train (name or path; also read by the
                         ClientApp): model, recipe, test set for server-side evaluation
``seed``                 int; the model's initialisation, sampling, the parties' data
``rounds``               rounds to run (0: the scenario's ``training.rounds``)
``per-round``            parties per round (0: the scenario's ``fleet.per_round``)
``run-store``            path of the SQLite run store (:class:`.run_store.RunStore`)
``run-id``               the run's name in the store ("": ``flwr-<Flower run id>``)
``round-timeout-s``      wall seconds a round may last at most (default 600)
``min-nodes``            wait until this many nodes are connected before round 1
``node-wait-s``          ... for at most this long (default 120)
deadline keys            ``over-selection``, ``quorum-fraction``, ``deadline-factor``,
                         ``late-policy``, ``staleness-exponent``
tiered keys              ``tiers``, ``profiling-rounds``, ``profiling-deadline-s``,
                         ``adaptive``, ``interval``, ``credits-per-tier``, ``retier-interval``,
                         ``dropout-threshold-s`` (also read by ``distill`` and ``nested``)
nested keys              ``tier-archs`` (comma-separated, fastest tier first)
distill keys             ``tier-archs`` (comma-separated, fastest tier first),
                         ``temperature``, ``distill-epochs``, ``distill-lr``,
                         ``distill-batch-size``; the proxy set is the scenario's split
fedprox keys             ``proximal-mu``
server optimizer keys    ``server-opt`` (``fedadam``, ``fedyogi``, ``fedadagrad``,
                         ``fedavgm``; "" = none), ``server-lr``, ``beta1``, ``beta2``,
                         ``tau`` (every strategy but ``distill`` and ``nested``;
                         ``server-lr`` 0 = the optimizer's default; ``fedavgm`` reads only
                         ``beta1``)
=======================  ==================================================================

A Flower run config has no "unset": a deadline or threshold key set to 0 means *off*
(``deadline-factor``, ``profiling-deadline-s``, ``dropout-threshold-s``,
``retier-interval``, ``credits-per-tier``). Keys of another strategy kind are ignored, so
one app config can hold them all.

The strategy runs on the wall clock: a round ends at its quorum or its deadline, and
parties still working are *late*, parties that answered with an error *failed*. Every
round is recorded in the run store as it ends; the parties' latency profiles (and tiers)
are saved when the run ends, however it ends. Nodes are shown to the strategy as
``1000 + partition-id`` (:class:`~fedge.aggregator.fleet.identity.PartitionOrderedGrid`), so the
store names parties the same way in deployment and in simulation.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import INFO
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from fedge.aggregator.fleet.grids import wait_for_nodes
from fedge.aggregator.fleet.identity import PartitionOrderedGrid
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.strategies.factory import build_strategy
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.aggregator.strategies.tiered import TieredFedAvg
from fedge.sim.errors import SimError

UserConfigValue = bool | int | float | str

DEADLINE_KEYS = (
    "over-selection",
    "quorum-fraction",
    "deadline-factor",
    "late-policy",
    "staleness-exponent",
)
TIERED_KEYS = (
    "tiers",
    "profiling-rounds",
    "profiling-deadline-s",
    "adaptive",
    "interval",
    "credits-per-tier",
    "retier-interval",
    "dropout-threshold-s",
)
DISTILL_KEYS = ("tier-archs", "temperature", "distill-epochs", "distill-lr", "distill-batch-size")
FEDPROX_KEYS = ("proximal-mu",)
SERVER_OPT_KEYS = ("server-opt", "server-lr", "beta1", "beta2", "tau")
OFF_WHEN_ZERO = frozenset(
    (
        "deadline-factor",
        "profiling-deadline-s",
        "dropout-threshold-s",
        "retier-interval",
        "credits-per-tier",
        "server-lr",  # 0: the server optimizer's default
    )
)
DEFAULT_ROUND_TIMEOUT_S = 600.0
DEFAULT_NODE_WAIT_S = 120.0
DISCOVERY_TIMEOUT_S = 60.0


class ServerConfigError(SimError):
    """The ServerApp's run config is missing a key or holds an unusable value."""


@dataclass(frozen=True)
class ServerSettings:
    """What one deployed run is: strategy, rounds, store -- parsed from the run config."""

    strategy: str
    strategy_params: dict[str, UserConfigValue | list[str]]
    scenario: str
    seed: int
    rounds: int  # 0: the scenario's
    per_round: int  # 0: the scenario's
    run_store: Path
    run_id: str  # "": derived from Flower's run id
    round_timeout_s: float = DEFAULT_ROUND_TIMEOUT_S
    min_nodes: int = 0
    node_wait_s: float = DEFAULT_NODE_WAIT_S
    manifest: dict[str, UserConfigValue] = field(default_factory=dict)

    @classmethod
    def from_run_config(cls, config: Mapping[str, UserConfigValue]) -> ServerSettings:
        strategy = _text(config, "strategy")
        keys: tuple[str, ...] = DEADLINE_KEYS
        server_opt = str(config.get("server-opt", ""))
        if server_opt == "fedavgm":  # server momentum has no second moment
            keys += ("server-opt", "server-lr", "beta1")
        elif server_opt:  # "": no server optimizer, its keys ignored
            keys += SERVER_OPT_KEYS
        if strategy in ("tiered", "distill", "nested"):
            keys += TIERED_KEYS
        if strategy == "distill":
            keys += DISTILL_KEYS
        if strategy == "nested":
            keys += ("tier-archs",)
        if strategy == "fedprox":
            keys += FEDPROX_KEYS
        params: dict[str, UserConfigValue | list[str]] = {}
        for key in keys:
            if key not in config:
                continue
            value = config[key]
            if key in OFF_WHEN_ZERO and not isinstance(value, bool) and value == 0:
                continue
            if key == "tier-archs":  # a run config holds no lists
                params["tier_archs"] = [a.strip() for a in str(value).split(",") if a.strip()]
                continue
            params[key.replace("-", "_")] = value
        return cls(
            strategy=strategy,
            strategy_params=params,
            scenario=_text(config, "scenario"),
            seed=_integer(config, "seed", minimum=0),
            rounds=_integer(config, "rounds", minimum=0, default=0),
            per_round=_integer(config, "per-round", minimum=0, default=0),
            run_store=Path(_text(config, "run-store")),
            run_id=str(config.get("run-id", "")),
            round_timeout_s=_number(config, "round-timeout-s", DEFAULT_ROUND_TIMEOUT_S),
            min_nodes=_integer(config, "min-nodes", minimum=0, default=0),
            node_wait_s=_number(config, "node-wait-s", DEFAULT_NODE_WAIT_S),
            manifest=dict(config),
        )


def run_server(grid: Grid, context: Context) -> None:
    """Run one deployed job on ``grid`` as the run config in ``context`` says."""
    # Heavy imports (torch, the scenario's data) stay out of module import.
    from fedge.models import digits
    from fedge.sim.data import make_partitions
    from fedge.sim.runner import evaluator, train_config
    from fedge.sim.scenario import load_scenario

    settings = ServerSettings.from_run_config(context.run_config)
    scenario = load_scenario(settings.scenario)
    run_id = settings.run_id or f"flwr-{context.run_id}"
    rounds = settings.rounds or scenario.training.rounds
    settings.run_store.parent.mkdir(parents=True, exist_ok=True)
    store = RunStore(settings.run_store)
    try:
        if store.run(run_id) is None:
            store.create_run(run_id, json.dumps(settings.manifest), RunState.RUNNING)
        else:
            store.set_state(run_id, RunState.RUNNING)

        def on_round(record: RoundRecord) -> None:
            store.record_round(run_id, record)

        strategy: StreamingFedAvg | None = None
        try:
            # Inside the try: a scenario or strategy that cannot be built is a FAILED run.
            data = make_partitions(scenario, settings.seed)
            strategy, extra = build_strategy(
                settings.strategy,
                settings.strategy_params,
                per_round=settings.per_round or scenario.fleet.per_round,
                seed=settings.seed,
                clock=ClockMode.WALL,
                proxy_X=data.proxy_X,
            )
            arch = str(extra.get("arch", scenario.training.arch))  # distill: the largest
            strategy.observers.append(on_round)
            ordered = PartitionOrderedGrid(grid, discovery_timeout_s=DISCOVERY_TIMEOUT_S)
            _wait_for_nodes(ordered, settings.min_nodes, settings.node_wait_s)
            strategy.start(
                ordered,
                digits.to_arrays(digits.make_model(arch, seed=settings.seed)),
                num_rounds=rounds,
                timeout=settings.round_timeout_s,
                train_config=train_config(scenario, extra),
                evaluate_fn=evaluator(scenario, data, arch=arch),
            )
            tiers = strategy.tiers if isinstance(strategy, TieredFedAvg) else None
            store.save_profiles(run_id, strategy.profiles, tiers)
        except BaseException as exc:
            # Whatever fails, the run says so: a run left "running" would be waited on.
            store.set_state(run_id, RunState.FAILED, f"{type(exc).__name__}: {exc}")
            if strategy is not None:
                with contextlib.suppress(Exception):
                    tiers = strategy.tiers if isinstance(strategy, TieredFedAvg) else None
                    store.save_profiles(run_id, strategy.profiles, tiers)
            raise
        store.set_state(run_id, RunState.COMPLETED)
        log(INFO, "run %s completed: %d rounds recorded in %s", run_id, rounds, settings.run_store)
    finally:
        store.close()


def _wait_for_nodes(grid: Grid, count: int, wait_s: float) -> None:
    if count <= 0:
        return
    seen = wait_for_nodes(grid, count, wait_s)
    if seen < count:
        raise ServerConfigError(
            f"only {seen} of min-nodes = {count} nodes connected within {wait_s:.0f}s"
        )


# ---------------------------------------------------------------- run config values


def _text(config: Mapping[str, UserConfigValue], key: str) -> str:
    value = config.get(key)
    if not isinstance(value, str) or not value:
        raise ServerConfigError(f"run_config[{key!r}] must be a non-empty string, got {value!r}")
    return value


def _integer(
    config: Mapping[str, UserConfigValue], key: str, *, minimum: int, default: int | None = None
) -> int:
    if key not in config and default is not None:
        return default
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ServerConfigError(
            f"run_config[{key!r}] must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _number(config: Mapping[str, UserConfigValue], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ServerConfigError(f"run_config[{key!r}] must be a number > 0, got {value!r}")
    return float(value)


# ---------------------------------------------------------------- the Flower adapter

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the job the run config describes (see the module docstring)."""
    run_server(grid, context)

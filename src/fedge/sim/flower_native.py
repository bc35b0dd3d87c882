"""Flower's own strategies (``FedAdam``, ``FedYogi``, ``FedAdagrad``, ``FedAvgM``, ``FedAvg``)
driving a scenario's parties, timed on the same virtual clock as fedge's strategies.

The peer for fedge's server optimizers (issue 29): a scenario table with ``kind =
"flwr-fedadam"`` (or ``flwr-fedyogi``, ``flwr-fedadagrad``, ``flwr-fedavgm``,
``flwr-fedavg``) runs Flower's class itself, its ``Strategy.start`` included -- Flower's
sampling (``fraction_train`` of the nodes, uniformly, Python's ``random``, seeded with the
run's seed), Flower's wait for every reply, Flower's aggregation and server step (its
FedAdam has Adam's bias correction, which Reddi et al.'s Algorithm 2 does not). Nothing of
fedge's round loop is used. ``fedge sim --backend flower`` runs it on Flower's simulation
runtime, the in-process backend on fedge's grid.

Virtual time: Flower's round waits for all its replies, so it lasts as long as the slowest
party's reported ``virtual-time-s`` -- what fedge's loop charges a round without a
deadline. :class:`_VirtualClock` reads it off the replies as they pass.

Parameters (the fedge names, so one table reads like the other): ``server_lr`` (Flower's
``eta``; FedAvgM's ``server_learning_rate``), ``beta1`` (``beta_1``; FedAvgM's
``server_momentum``), ``beta2`` (``beta_2``), ``tau``, ``eta_l``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi

from fedge.aggregator.fleet.grids import WrappedGrid
from fedge.aggregator.rounds.record import RoundRecord
from fedge.datasets.tables import Partitions
from fedge.models import digits
from fedge.sim.errors import SimError
from fedge.sim.runner import Curve, ProgressFn, evaluator, group_accuracy, train_config
from fedge.sim.scenario import Scenario

NATIVE: dict[str, type[FedAvg]] = {
    "flwr-fedadam": FedAdam,
    "flwr-fedyogi": FedYogi,
    "flwr-fedadagrad": FedAdagrad,
    "flwr-fedavgm": FedAvgM,
    "flwr-fedavg": FedAvg,
}
_ADAPTIVE = {
    "server_lr": "eta",
    "beta1": "beta_1",
    "beta2": "beta_2",
    "tau": "tau",
    "eta_l": "eta_l",
}
_MOMENTUM = {"server_lr": "server_learning_rate", "beta1": "server_momentum"}
_NAMES: dict[str, dict[str, str]] = {
    "flwr-fedadam": _ADAPTIVE,
    "flwr-fedyogi": _ADAPTIVE,
    "flwr-fedadagrad": {k: v for k, v in _ADAPTIVE.items() if k != "beta2"},
    "flwr-fedavgm": _MOMENTUM,
    "flwr-fedavg": {},
}


def is_native(params: dict[str, object]) -> bool:
    """Whether a scenario's strategy table names one of Flower's own strategies."""
    return params.get("kind") in NATIVE


def build_native(name: str, params: dict[str, object], *, per_round: int, parties: int) -> FedAvg:
    """Flower's strategy for ``params`` (its ``kind`` one of :data:`NATIVE`), sampling
    ``per_round`` of ``parties`` a round; an unknown or mistyped key is a SimError."""
    kind = str(params["kind"])
    names = _NAMES[kind]
    kwargs: dict[str, float] = {}
    for key, value in params.items():
        if key == "kind":
            continue
        if key not in names:
            raise SimError(
                f"strategies.{name}.{key}: not a parameter of Flower's {kind} "
                f"(known: {sorted(names)})"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SimError(f"strategies.{name}.{key}: expected a number, got {value!r}")
        kwargs[names[key]] = float(value)
    try:
        return NATIVE[kind](
            fraction_train=per_round / parties,
            min_train_nodes=per_round,
            min_available_nodes=parties,
            fraction_evaluate=0.0,  # the job's own evaluation reports accuracy
            min_evaluate_nodes=0,
            **kwargs,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as exc:
        raise SimError(f"strategies.{name}: {exc}") from None


class _VirtualClock(WrappedGrid):
    """Forwards everything; notes each train round's parties and its virtual length."""

    def __init__(self, inner: Grid) -> None:
        super().__init__(inner)
        self.elapsed_s = 0.0
        self.records: list[RoundRecord] = []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        sent = list(messages)
        replies = list(self.inner.send_and_receive(sent, timeout=timeout))
        if not sent or sent[0].metadata.message_type != MessageType.TRAIN:
            return replies
        times: dict[int, float] = {}
        failures: dict[int, str] = {}
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                failures[node] = reply.error.reason or "error reply"
                continue
            for record in reply.content.metric_records.values():
                value = record.get("virtual-time-s")
                if isinstance(value, int | float):
                    times[node] = float(value)
        selected = tuple(m.metadata.dst_node_id for m in sent)
        for node in selected:
            if node not in times and node not in failures:
                failures[node] = "no answer within Flower's timeout"
        round_time = max(times.values(), default=0.0)
        self.elapsed_s += round_time
        self.records.append(
            RoundRecord(
                server_round=len(self.records) + 1,
                selected=selected,
                on_time=tuple(n for n in selected if n in times),
                late=(),
                failed=tuple(n for n in selected if n in failures),
                round_time_s=round_time,
                elapsed_s=self.elapsed_s,
                quorum=len(selected),
                quorum_met=not failures,
                deadline_s=None,
                failures=failures,
            )
        )
        return replies


def drive_native(
    scenario: Scenario,
    strategy_name: str,
    seed: int,
    grid: Grid,
    data: Partitions,
    progress: ProgressFn | None,
) -> Curve:
    """One run of Flower's own strategy on a ready grid: the same curve as ``drive``'s."""
    started = time.perf_counter()
    strategy = build_native(
        strategy_name,
        scenario.strategy(strategy_name),
        per_round=scenario.fleet.per_round,
        parties=scenario.fleet.parties,
    )
    arch = scenario.training.arch
    total = scenario.rounds_for(strategy_name)
    clock = _VirtualClock(grid)
    evaluate = evaluator(scenario, data, arch=arch)
    accuracy: dict[int, float] = {}
    walls: list[float] = []
    last = [time.perf_counter()]

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        metrics = evaluate(server_round, arrays)
        accuracy[server_round] = float(metrics["accuracy"])  # type: ignore[arg-type]
        if server_round > 0:
            now = time.perf_counter()
            walls.append(now - last[0])
            last[0] = now
            if progress is not None:
                progress(f"{strategy_name} seed {seed}", server_round, total)
        return metrics

    # Flower samples with Python's global ``random``, which its runtime also draws from
    # between rounds: seeded afresh before each round's sampling, a run is the same on
    # either backend (still uniform sampling; only where the randomness comes from).
    configure = strategy.configure_train

    def seeded_configure(
        server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        random.seed(seed * 100_003 + server_round)
        return configure(server_round, arrays, config, grid)

    strategy.configure_train = seeded_configure  # type: ignore[method-assign]
    config: dict[str, Any] = dict(train_config(scenario, {}))
    result = strategy.start(
        grid=clock,
        initial_arrays=digits.to_arrays(digits.make_model(arch, seed=seed)),
        num_rounds=total,
        timeout=600,
        train_config=ConfigRecord(config),
        evaluate_fn=evaluate_fn,
    )
    records = tuple(clock.records)
    return Curve(
        strategy=strategy_name,
        seed=seed,
        times_s=(0.0, *(r.elapsed_s for r in records)),
        accuracy=tuple(accuracy[r] for r in range(len(records) + 1)),
        target=scenario.training.target_accuracy,
        group_accuracy=group_accuracy(scenario, data, result.arrays, arch=arch),
        wall_s=time.perf_counter() - started,
        rounds=records,
        round_wall_s=tuple(walls),
    )

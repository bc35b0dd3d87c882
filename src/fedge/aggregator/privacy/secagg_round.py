"""One SecAgg+ round: Flower's ``SecAggPlusWorkflow`` driven by our strategy.

Flower's workflow talks to a *legacy* ``Strategy`` (``configure_fit`` / ``aggregate_fit``
over ``ClientProxy`` and ``FitIns``/``FitRes``). :class:`SecAggRound` is that strategy for
one round, a facade over our :class:`~fedge.aggregator.strategies.streaming.StreamingFedAvg`:

* ``configure_fit`` asks our strategy's ``plan`` who takes part (the round's TiFL tier,
  over-selection) and sends each party our round config (``_round_config_record``) plus
  the model's array names (legacy parameters carry none; the party's
  :func:`fedge.party.secagg.secagg_mod` names them again);
* ``aggregate_fit`` gets the unmasked weighted mean -- the same aggregate in every
  ``FitRes``, never one party's update -- and the parties' metrics; the round is closed
  by our strategy's ``close_round`` as our own loop closes one: the mean becomes the new
  model, replies update latency profiles and tier accuracies (``local-acc``), failures
  and observers are recorded.

The round's deadline (``DeadlineConfig.deadline_factor`` times the tier's expected
latency, or TiFL's profiling deadline) applies at the masked-vector stage, the one that
trains, on both clocks (issue 32): on the wall clock the stage waits until the deadline;
on the virtual clock every party answers at once and a masked vector whose reported
``virtual-time-s`` is past the deadline is set aside before the vectors are summed. A
party past the deadline is *late* and, to the protocol, a dropout: its vector is not in
the sum, and its neighbours reveal the shares of its pairwise-mask key, never of its
private mask, so even a vector the server holds stays hidden (Bell et al., CCS 2020, the
"dropped after sending" case). A late vector cannot be folded into a later round (its
masks only cancel in its own round's sum), so it is dropped whatever ``late_policy`` says.
While at least the reconstruction threshold (never fewer than 3) is on time, the round's
aggregate is exact over the on-time parties; below it the round is abandoned, saying how
many were late. The key stages wait ``key_stage_timeout_s``. :class:`StageRecorder`
notes, per party, the stage it failed at, when its masked vector arrived, and who was late.

Never fewer than three (issue 24): the round's reconstruction threshold is at least 3
(``SecAggSettings.round_threshold``), and :class:`_DeadlineWorkflow` abandons a round
whose masked vectors came from fewer than 3 parties before asking for a single share
(:func:`check_survivors`): the sum of two is each one's update to the other. An abandoned
round applies no aggregate; every party is recorded failed with the reason; the run goes
on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from logging import WARNING
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid
from flwr.supercore import log

from fedge.aggregator.fleet.grids import WrappedGrid
from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.rounds.clock import VIRTUAL_TIME_KEY, ClockMode
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.rounds.replies import Collected, layout, sort_replies
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.privacy.settings import SECAGG_MIN_PARTIES, PrivacyError

if TYPE_CHECKING:
    from fedge.aggregator.privacy.secagg import SecAggSettings

NUM_EXAMPLES = "num-examples"
ARRAY_NAMES_KEY = "secagg-array-names"
"""FitIns config key: the model's array names, JSON (``fedge.party.secagg`` reads it)."""
HALTED = "SecAgg+ halted: too few parties survived to unmask the round"
ABANDONED = "SecAgg+ round abandoned"
FITRES_METRICS = "fitres.metrics"
"""Where a masked-vector reply carries the party's metrics in the clear (Flower's compat)."""


def check_survivors(survivors: int) -> None:
    """A sum of ``survivors`` masked updates may be unmasked (else PrivacyError)."""
    if survivors < SECAGG_MIN_PARTIES:
        raise PrivacyError(
            f"only {survivors} parties' masked vectors arrived, fewer than "
            f"{SECAGG_MIN_PARTIES}: their unmasked sum would show each one the other's "
            "update, so nothing is unmasked"
        )


@dataclass(frozen=True)
class NodeMap:
    """The grid the protocol talks to, and how the strategy's party ids map onto it."""

    wire: Grid
    to_wire: Callable[[int], int]
    from_wire: Callable[[int], int]


def masked_vector_time(reply: Message) -> float | None:
    """The ``virtual-time-s`` a simulated party reports with its masked vector (None: none).

    ``secaggplus_mod`` keeps the app's metrics beside the masked vector, in the clear.
    """
    metrics = reply.content.config_records.get(FITRES_METRICS)
    value = None if metrics is None else metrics.get(VIRTUAL_TIME_KEY)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def past_deadline(times_s: dict[int, float | None], deadline_s: float | None) -> set[int]:
    """The parties whose masked vector came after the deadline (a time of None: unknown,
    so on time -- a party that reports no virtual time was timed by the wait itself)."""
    if deadline_s is None:
        return set()
    return {node for node, at in times_s.items() if at is not None and at > deadline_s}


class StageRecorder(WrappedGrid):
    """Forwards everything; notes who failed at which stage and when vectors arrived, and
    holds back the masked vectors that came after the round's deadline (they are late)."""

    def __init__(self, inner: Grid) -> None:
        super().__init__(inner)
        self.failures: dict[int, str] = {}  # wire node id -> why (first failure only)
        self.arrival_s: dict[int, float] = {}  # wire node id -> masked vector's latency
        self.late_s: dict[int, float | None] = {}  # wire node id -> its time (None: unknown)
        self.deadline_s: float | None = None  # the round's, set when the round is planned
        self.clock = ClockMode.WALL
        self.waited_s: dict[str, float] = {}  # stage -> wall seconds it waited for replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        sent = list(messages)
        stage = stage_of(sent)
        sent_at, started = time.time(), time.monotonic()
        replies = list(self.inner.send_and_receive(sent, timeout=timeout))
        self.waited_s[stage] = time.monotonic() - started
        collecting = stage == Stage.COLLECT_MASKED_VECTORS
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                reason = str(reply.error.reason or reply.error.code)
                self.failures.setdefault(node, f"SecAgg+ {stage} stage: {reason}")
            elif collecting:
                self.arrival_s[node] = max(0.0, reply.metadata.created_at - sent_at)
        if collecting and self.clock is ClockMode.VIRTUAL:
            replies = self._set_aside_late(replies)
        answered = {reply.metadata.src_node_id for reply in replies} | set(self.late_s)
        for message in sent:
            node = message.metadata.dst_node_id
            if node in answered:
                continue
            if collecting and self.clock is ClockMode.WALL and self.deadline_s is not None:
                # The stage waited until the deadline (its timeout): still working is late.
                self.late_s[node] = None
            else:
                waited = self.waited_s[stage]
                reason = f"SecAgg+ {stage} stage: no answer within {timeout} s"
                self.failures.setdefault(node, f"{reason} (waited {waited:.1f} s)")
        return replies

    def _set_aside_late(self, replies: list[Message]) -> list[Message]:
        """Virtual clock: the replies all came at once; those whose virtual time is past
        the deadline are withheld from the workflow, which then treats them as dropouts."""
        times = {
            reply.metadata.src_node_id: masked_vector_time(reply)
            for reply in replies
            if not reply.has_error()
        }
        late = past_deadline(times, self.deadline_s)
        for node in late:
            self.late_s[node] = times[node]
            self.arrival_s.pop(node, None)
        return [reply for reply in replies if reply.metadata.src_node_id not in late]


class _DeadlineWorkflow(SecAggPlusWorkflow):
    """Flower's workflow with its own timeout for the stage that trains, which never
    unmasks fewer than three parties' vectors and says why a round stopped."""

    collect_timeout: float | None = None
    abandoned = ""  # why the round produced no aggregate ("": it did, or not known)

    def setup_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        return self._noted("setup", state, super().setup_stage(grid, context, state))

    def share_keys_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        return self._noted("share keys", state, super().share_keys_stage(grid, context, state))

    def collect_masked_vectors_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        key_timeout, self.timeout = self.timeout, self.collect_timeout
        try:
            done = bool(super().collect_masked_vectors_stage(grid, context, state))
        finally:
            self.timeout = key_timeout
        if isinstance(grid, StageRecorder):  # say how many the deadline cost the round
            late, by = len(grid.late_s), grid.deadline_s
            return self._noted("masked vectors", state, done, late=late, by=by)
        return self._noted("masked vectors", state, done)

    def unmask_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        # The sum holds exactly the vectors of the parties still active here (Flower
        # unmasks those even if some then fail to send their shares).
        try:
            check_survivors(len(state.active_node_ids))
        except PrivacyError as exc:
            self.abandoned = str(exc)
            log(WARNING, "%s: %s", ABANDONED, exc)
            return False
        return bool(super().unmask_stage(grid, context, state))

    def _noted(
        self, stage: str, state: Any, done: bool, *, late: int = 0, by: float | None = None
    ) -> bool:
        if not done and not self.abandoned and state.sampled_node_ids:
            past = (
                f" ({late} past the round's deadline of {by:.4g} s)"
                if late and by is not None
                else ""
            )
            self.abandoned = (
                f"after the {stage} stage {len(state.active_node_ids)} of "
                f"{len(state.sampled_node_ids)} parties were left{past}, below the "
                f"reconstruction threshold of {state.threshold}"
            )
        return bool(done)


class SecAggRound(Strategy):
    """The legacy strategy Flower's SecAgg+ workflow drives, for one round of ours."""

    def __init__(
        self,
        strategy: StreamingFedAvg,
        grid: Grid,
        nodes: NodeMap,
        stages: StageRecorder,
        settings: SecAggSettings,
        arrays: ArrayRecord,
        config: ConfigRecord,
        *,
        timeout: float,
    ) -> None:
        self.strategy = strategy
        self.grid = grid  # what the strategy plans over
        self.nodes = nodes
        self.stages = stages
        self.settings = settings
        self.arrays = arrays
        self.config = config
        self.timeout = timeout
        self.names = list(arrays.keys())
        self.workflow = _DeadlineWorkflow(
            num_shares=settings.num_shares,
            reconstruction_threshold=(
                settings.threshold_count or float(settings.reconstruction_threshold)
            ),
            max_weight=settings.max_weight,
            clipping_range=settings.clipping_range,
            quantization_range=settings.quantization_range,
            modulus_range=settings.modulus_range,
            timeout=settings.key_stage_timeout_s,
        )
        self.workflow.collect_timeout = timeout
        self.planned: tuple[deadlines.RoundPlan, int | None] | None = None
        self.outcome: tuple[ArrayRecord, RoundRecord] | None = None
        self.lost = ""  # why the round could not run at all

    def run(self, server_round: int, context: Context) -> tuple[ArrayRecord, RoundRecord]:
        """Run the round's four stages; the new model and the round's record."""
        legacy = LegacyContext(context, strategy=self, client_manager=SimpleClientManager())
        legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {WorkflowKey.CURRENT_ROUND: server_round}
        )
        legacy.state.array_records[MAIN_PARAMS_RECORD] = self.arrays
        self.workflow(self.stages, legacy)
        if self.outcome is not None:
            return self.outcome
        if self.planned is None:
            raise PrivacyError(f"round {server_round}: SecAgg+ selected no parties")
        # Halted below the threshold: the round is lost, the run goes on.
        return self._close(server_round, None, {})

    # -- the legacy Strategy contract

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        plan, tier = self.strategy.plan(server_round, self.grid)
        self.planned = (plan, tier)
        try:
            self.settings.check_round(len(plan.selected))
        except PrivacyError as exc:
            # Checked against per_round before round 1; a tier can still shrink below the
            # threshold (its parties out of privacy budget): this round is lost, the run
            # goes on, and every party asked is recorded as failed, saying why.
            log(WARNING, "round %d: %s", server_round, exc)
            self.lost = str(exc)
            return []
        # At least 3 (a share is resolved for this round's size, then raised to 3).
        self.workflow.reconstruction_threshold = self.settings.round_threshold(len(plan.selected))
        self.stages.deadline_s, self.stages.clock = plan.deadline_s, self.strategy.clock
        if self.strategy.clock is ClockMode.WALL and plan.deadline_s is not None:
            self.workflow.collect_timeout = plan.deadline_s
        config = self.strategy._round_config_record(server_round, self.config, plan)
        config[ARRAY_NAMES_KEY] = json.dumps(self.names)
        fit_config = cast(dict[str, Scalar], dict(config))
        run_id = self.nodes.wire.run.run_id
        return [
            (
                GridClientProxy(self.nodes.to_wire(node), self.nodes.wire, run_id),
                FitIns(parameters, fit_config),
            )
            for node in plan.selected
        ]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        metrics = {
            self.nodes.from_wire(int(proxy.cid)): _party_metrics(res) for proxy, res in results
        }
        aggregate = _named_aggregate(self.arrays, self.names, results[0][1].parameters)
        self.outcome = self._close(server_round, aggregate, metrics)
        return None, {}

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        return []

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        return None, {}

    def evaluate(
        self, server_round: int, parameters: Parameters
    ) -> tuple[float, dict[str, Scalar]] | None:
        return None

    # -- closing the round as our loop does

    def _close(
        self,
        server_round: int,
        aggregate: dict[str, np.ndarray] | None,
        metrics: dict[int, dict[str, float]],
    ) -> tuple[ArrayRecord, RoundRecord]:
        assert self.planned is not None
        plan, tier = self.planned
        shown = {self.nodes.to_wire(node): node for node in plan.selected}
        replies = {node: _metrics_reply(node, values) for node, values in metrics.items()}
        wall = {shown[w]: s for w, s in self.stages.arrival_s.items() if w in shown}
        wall = {node: wall.get(node, 0.0) for node in replies}
        abandoned = self.workflow.abandoned
        missing = f"{ABANDONED}: {abandoned}" if abandoned else HALTED
        collected: Collected = sort_replies(plan.selected, replies, wall, missing=missing)
        for wire_node, reason in self.stages.failures.items():
            node = shown.get(wire_node)
            if node is not None and node not in metrics:
                collected.fail(node, reason)
        if self.lost:
            for node in plan.selected:
                collected.fail(node, f"SecAgg+ round not run: {self.lost}")
        # Late: past the deadline at the masked-vector stage. Neither on time nor failed; a
        # known (virtual) time updates its latency profile, an unknown one is charged the
        # deadline (latency.observe_round), as in our own loop.
        late = {shown[w]: s for w, s in self.stages.late_s.items() if w in shown}
        for node, seconds in late.items():
            collected.arrivals[node] = seconds
            collected.failures.pop(node, None)
        arrivals = collected.arrivals
        on_time = tuple(
            sorted((n for n in plan.selected if n in metrics), key=lambda n: arrivals[n] or 0.0)
        )
        ended = max((arrivals[n] or 0.0 for n in on_time), default=0.0)
        if late and plan.deadline_s is not None:
            ended = plan.deadline_s  # the masked-vector stage waited until the deadline
        settlement = deadlines.Settlement(
            on_time=on_time,
            late=tuple(sorted(late, key=lambda n: (late[n] is None, late[n] or 0.0, n))),
            failed=tuple(n for n in plan.selected if n not in metrics and n not in late),
            round_time_s=ended,
            quorum_met=len(on_time) >= plan.quorum,
        )
        folds: dict[str, StreamingMean] = {}
        if aggregate is not None:
            fold = folds.setdefault("", StreamingMean())
            fold.add(aggregate, 1.0)  # already the weighted mean of the round's parties
        return self.strategy.close_round(
            server_round, self.arrays, plan, tier, folds, settlement, collected, 0
        )


def stage_of(messages: list[Message]) -> str:
    """The SecAgg+ stage a batch of messages asks for ("unknown": none)."""
    for message in messages:
        record = message.content.config_records.get(RECORD_KEY_CONFIGS)
        if record is not None and Key.STAGE in record:
            return str(record[Key.STAGE])
    return "unknown"


def _party_metrics(res: FitRes) -> dict[str, float]:
    """A party's numeric metrics (its update is not among them: only the mean is)."""
    values = {
        key: float(value)
        for key, value in res.metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    values[NUM_EXAMPLES] = float(res.num_examples)
    return values


def _metrics_reply(node: int, metrics: dict[str, float]) -> Message:
    """A party's metrics as our observers read a reply (``"metrics"``)."""
    content = RecordDict({"metrics": MetricRecord(dict(metrics))})
    return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN)


def _named_aggregate(
    sent: ArrayRecord, names: list[str], parameters: Parameters
) -> dict[str, np.ndarray]:
    """The unmasked mean, named, shaped and typed as the model that was sent."""
    values = parameters_to_ndarrays(parameters)
    shapes = layout(sent)
    if len(values) != len(names):
        raise ValueError(f"SecAgg+ returned {len(values)} arrays for a {len(names)}-array model")
    named = {}
    for name, value in zip(names, values, strict=True):
        shape, dtype = shapes[name]
        named[name] = np.asarray(value, dtype=dtype).reshape(shape)
    return named

"""The round loop every fedge strategy shares: push, pull until quorum or deadline, fold.

Flower's ``Strategy.start`` sends a round's messages and waits for every reply before
aggregating (``grid.send_and_receive``): one straggler decides the round's length and all
replies sit in memory at once. This loop keeps Flower's contract -- ``configure_train``
builds the messages, replies are Flower ``Message``s, an error reply is a failure -- and
changes the waiting:

- replies are pulled as they arrive and folded into a running weighted mean (memory: one
  model, not one per party);
- a round ends at its k-of-n quorum or its deadline, whichever comes first (see
  :mod:`fedge.aggregator.deadline`); parties still working are *late*, errors *failed*;
  both are recorded, never waited on;
- late replies are dropped or folded into a later round with a staleness weight
  (FedBuff, Nguyen et al., AISTATS'22), by configuration.

In simulation the clock is virtual: replies come back at once and carry the time their
work would have taken (``virtual-time-s``), so they are settled in virtual arrival order
(deterministic for a seed). Any Flower ClientApp works: without a virtual time, the wall
time from push to pull is the party's latency.
"""

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from fedge.aggregator import deadline as deadlines
from fedge.aggregator import tiers
from fedge.aggregator.clock import VIRTUAL_TIME_KEY, ClockMode
from fedge.aggregator.fold import StreamingMean
from fedge.aggregator.rounds import RoundObserver, RoundRecord

NUM_EXAMPLES = "num-examples"


@dataclass(frozen=True)
class DeadlineConfig:
    """Deadline mode, usable with any selection (all off by default = plain FedAvg)."""

    over_selection: float = 0.0  # select ceil(k * (1 + over_selection)) parties
    quorum_fraction: float = 1.0  # the round may end once this share of k replied
    deadline_factor: float | None = None  # deadline = expected latency * factor
    late_policy: str = "drop"  # "drop" or "stale" (fold later with a staleness weight)
    staleness_exponent: float = 0.5

    def __post_init__(self) -> None:
        if self.over_selection < 0:
            raise ValueError(f"over_selection must be >= 0, got {self.over_selection}")
        if not 0 < self.quorum_fraction <= 1:
            raise ValueError(f"quorum_fraction must be in (0, 1], got {self.quorum_fraction}")
        if self.deadline_factor is not None and self.deadline_factor <= 0:
            raise ValueError(f"deadline_factor must be > 0, got {self.deadline_factor}")
        if self.late_policy not in ("drop", "stale"):
            raise ValueError(f"late_policy must be 'drop' or 'stale', got {self.late_policy!r}")


@dataclass
class _Late:
    arrays: dict[str, np.ndarray]
    weight: float
    origin_round: int
    group: str = ""  # the fold it belongs to (see StreamingFedAvg.fold_group)


def arrays_of(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: array.numpy() for key, array in record.items()}


def to_array_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord(
        array_dict={key: Array(np.ascontiguousarray(value)) for key, value in arrays.items()}
    )


class StreamingFedAvg(FedAvg):
    """FedAvg (McMahan et al., 2017) with streaming folds, deadlines and quorum.

    ``per_round`` parties are sampled uniformly per round (the baseline TiFL compares
    against); subclasses override :meth:`candidates` and :meth:`expected_latency` to
    change who is asked and how long to wait.
    """

    def __init__(
        self,
        *,
        per_round: int,
        seed: int = 0,
        clock: ClockMode = ClockMode.WALL,
        deadline: DeadlineConfig | None = None,
        pull_interval_s: float = 0.01,
        **fedavg_kwargs: Any,
    ) -> None:
        super().__init__(min_train_nodes=per_round, **fedavg_kwargs)
        if per_round < 1:
            raise ValueError(f"per_round must be >= 1, got {per_round}")
        self.per_round = per_round
        self.seed = seed
        self.clock = clock
        self.deadline = deadline or DeadlineConfig()
        self.pull_interval_s = pull_interval_s
        self.rng = np.random.default_rng(seed)
        self.profiles: dict[int, tiers.LatencyProfile] = {}
        self.elapsed_s = 0.0
        self.observers: list[RoundObserver] = []
        # Called with each round's record and its on-time replies (e.g. per-party metrics).
        self.reply_observers: list[Callable[[RoundRecord, dict[int, Message]], None]] = []
        self._late: list[_Late] = []
        self._sent: tuple[ArrayRecord, ...] = ()  # the model(s) sent this round
        # wall mode: message id -> node, round, t0, fold group
        self._pending: dict[str, tuple[int, int, float, str]] = {}

    # -- hooks for subclasses

    def candidates(
        self, server_round: int, node_ids: Sequence[int]
    ) -> tuple[Sequence[int], int | None]:
        """Who may be selected this round, and the tier they form (None = no tiers)."""
        return node_ids, None

    def expected_latency(self, server_round: int, tier: int | None) -> float | None:
        """The latency a deadline is derived from (None = no deadline this round)."""
        known = [p.mean_s for p in self.profiles.values()]
        return float(np.percentile(known, 90)) if known else None

    def round_config(self, server_round: int, plan: deadlines.RoundPlan) -> dict[str, Any]:
        """Extra config sent to the parties of this round."""
        return {}

    def after_round(self, record: RoundRecord, replies: dict[int, Message]) -> None:
        """Called once a round is settled (TiFL updates tier accuracies here)."""

    def fold_group(self, node: int) -> str:
        """Which running mean ``node``'s reply this round is folded into.

        FedAvg has one (``""``); a strategy that trains several models at once (one per
        architecture, :mod:`fedge.aggregator.feddf`) names one group per model. Called when
        the round's messages exist, so it may depend on what was sent to ``node``.
        """
        return ""

    def aggregate(
        self,
        server_round: int,
        arrays: ArrayRecord,
        folds: dict[str, StreamingMean],
        metrics: dict[str, float],
    ) -> ArrayRecord:
        """The round's new global model from its folds (``arrays``: what was sent).

        ``metrics`` are the round's training metrics; an override may add its own.
        """
        unexpected = sorted(set(folds) - {""})
        if unexpected:  # fold_group() was overridden without aggregate(): replies would vanish
            raise ValueError(f"{type(self).__name__} cannot aggregate fold groups {unexpected}")
        fold = folds.get("")
        return serialise(fold) if fold is not None and fold.count else arrays

    def extra_arrays(self) -> dict[str, dict[str, np.ndarray]]:
        """Models a checkpoint must keep besides the global one (name -> arrays)."""
        return {}

    def restore_extra_arrays(self, arrays: dict[str, dict[str, np.ndarray]]) -> None:
        """Take back what :meth:`extra_arrays` gave to a checkpoint."""
        if arrays:
            raise ValueError(f"{type(self).__name__} keeps no extra models, got {sorted(arrays)}")

    # -- state for checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "elapsed_s": self.elapsed_s,
            "profiles": {str(k): dataclasses.asdict(v) for k, v in self.profiles.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.elapsed_s = float(state["elapsed_s"])
        self.profiles = {int(k): tiers.LatencyProfile(**v) for k, v in state["profiles"].items()}

    def late_replies(self) -> list[tuple[dict[str, np.ndarray], float, int, str]]:
        """Late replies held for staleness folding: (arrays, weight, origin round, group).

        Kept out of :meth:`state_dict` because they are whole models: checkpoints store
        them as arrays beside the JSON state.
        """
        return [(late.arrays, late.weight, late.origin_round, late.group) for late in self._late]

    def restore_late_replies(
        self, replies: Iterable[tuple[dict[str, np.ndarray], float, int, str]]
    ) -> None:
        self._late = [
            _Late(dict(arrays), weight, origin, group) for arrays, weight, origin, group in replies
        ]

    # -- the loop

    def plan(self, server_round: int, grid: Grid) -> tuple[deadlines.RoundPlan, int | None]:
        node_ids = sorted(grid.get_node_ids())
        pool, tier = self.candidates(server_round, node_ids)
        expected = self.expected_latency(server_round, tier)
        plan = deadlines.plan_round(
            list(pool),
            self.per_round,
            over_selection=self.deadline.over_selection,
            quorum_fraction=self.deadline.quorum_fraction,
            expected_latency_s=expected if self.deadline.deadline_factor else None,
            deadline_factor=self.deadline.deadline_factor or 1.0,
            rng=self.rng,
        )
        return plan, tier

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        plan, _ = self.plan(server_round, grid)
        return self._messages(server_round, arrays, config, plan)

    def _messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        plan: deadlines.RoundPlan,
    ) -> list[Message]:
        round_config = self._round_config_record(server_round, config, plan)
        self._sent = (arrays,)
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: round_config})
        return [
            Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN)
            for node in plan.selected
        ]

    def _round_config_record(
        self, server_round: int, config: ConfigRecord, plan: deadlines.RoundPlan
    ) -> ConfigRecord:
        """The train config every party of this round gets: the job's, the round, hooks'."""
        round_config = ConfigRecord(dict(config))
        round_config["server-round"] = server_round
        for key, value in self.round_config(server_round, plan).items():
            round_config[key] = value
        return round_config

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        first_round: int = 1,
        checkpoint_fn: Callable[[int, ArrayRecord], None] | None = None,
    ) -> Result:
        """Run rounds ``first_round..num_rounds`` (a resumed job starts past round 1)."""
        train_config = train_config or ConfigRecord()
        result = Result()
        arrays = initial_arrays
        if evaluate_fn is not None and first_round == 1:
            initial = evaluate_fn(0, arrays)
            if initial is not None:
                result.evaluate_metrics_serverapp[0] = initial
        for server_round in range(first_round, num_rounds + 1):
            arrays, record = self.run_round(server_round, arrays, train_config, grid, timeout)
            if record.train_metrics:
                result.train_metrics_clientapp[server_round] = MetricRecord(
                    dict(record.train_metrics)
                )
            if evaluate_fn is not None:
                evaluated = evaluate_fn(server_round, arrays)
                if evaluated is not None:
                    result.evaluate_metrics_serverapp[server_round] = evaluated
                    record = dataclasses.replace(
                        record,
                        eval_metrics={k: float(v) for k, v in evaluated.items()},  # type: ignore[arg-type]
                    )
            for observer in self.observers:
                observer(record)
            if checkpoint_fn is not None:
                checkpoint_fn(server_round, arrays)
        result.arrays = arrays
        return result

    def run_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        timeout: float,
    ) -> tuple[ArrayRecord, RoundRecord]:
        plan, tier = self.plan(server_round, grid)
        messages = self._messages(server_round, arrays, config, plan)
        folds: dict[str, StreamingMean] = {}
        if self.clock is ClockMode.VIRTUAL:
            replies, arrivals, failures = self._collect_all(grid, messages, timeout)
            settlement = deadlines.settle(plan, arrivals)
            on_time = list(settlement.on_time)
        else:
            replies, arrivals, failures, settlement = self._collect_streaming(
                server_round, grid, messages, plan, timeout, folds
            )
            on_time = []
        stale_folded = self._fold_late(folds, server_round)
        for node in on_time:  # virtual mode: in virtual arrival order
            fold = folds.setdefault(self.fold_group(node), StreamingMean())
            fold.add(self._arrays(replies[node]), _weight(replies[node]))
        if self.deadline.late_policy == "stale" and self.clock is ClockMode.VIRTUAL:
            for node in settlement.late:
                late = replies[node]
                self._late.append(
                    _Late(self._arrays(late), _weight(late), server_round, self.fold_group(node))
                )
        metrics = _weighted_metrics([replies[n] for n in settlement.on_time if n in replies])
        new_arrays = self.aggregate(server_round, arrays, folds, metrics)
        record = self.close_round(
            server_round, plan, tier, settlement, arrivals, replies, failures, stale_folded, metrics
        )
        return new_arrays, record

    def close_round(
        self,
        server_round: int,
        plan: deadlines.RoundPlan,
        tier: int | None,
        settlement: deadlines.Settlement,
        arrivals: dict[int, float | None],
        replies: dict[int, Message],
        failures: dict[int, str],
        stale_folded: int,
        metrics: dict[str, float],
    ) -> RoundRecord:
        """What every round ends with, whatever it folded: profiles, clock, record, hooks."""
        self._update_profiles(arrivals, settlement, plan)
        self.elapsed_s += settlement.round_time_s
        record = RoundRecord(
            server_round=server_round,
            selected=tuple(plan.selected),
            on_time=tuple(settlement.on_time),
            late=tuple(settlement.late),
            failed=tuple(settlement.failed),
            round_time_s=settlement.round_time_s,
            elapsed_s=self.elapsed_s,
            quorum=plan.quorum,
            quorum_met=settlement.quorum_met,
            deadline_s=plan.deadline_s,
            tier=tier,
            stale_folded=stale_folded,
            train_metrics=metrics,
            failures=failures,
        )
        log(
            INFO,
            "round %d: tier %s, %d/%d on time, %d late, %d failed, %.2fs",
            server_round,
            tier,
            len(settlement.on_time),
            len(plan.selected),
            len(settlement.late),
            len(settlement.failed),
            settlement.round_time_s,
        )
        on_time_replies = {n: replies[n] for n in settlement.on_time if n in replies}
        self.after_round(record, on_time_replies)
        for observer in self.reply_observers:
            observer(record, on_time_replies)
        return record

    def _fold_reply(self, fold: StreamingMean, message: Message) -> None:
        """Decode and fold a reply one array at a time, emptying the reply as it goes."""
        record = message.content[self.arrayrecord_key]
        if not isinstance(record, ArrayRecord):
            raise ValueError(f"reply's {self.arrayrecord_key!r} is not an ArrayRecord")
        weight = _weight(message)
        if self._is_echo(record):  # an in-process party echoed what we sent: don't empty it
            fold.add(arrays_of(record), weight)
            return
        layout = {k: (tuple(a.shape), np.dtype(a.dtype)) for k, a in record.items()}
        if self._sent and not any(layout == _layout(sent) for sent in self._sent):
            raise ValueError("its arrays are not the model that was sent (names or shapes)")

        def decoded() -> Iterator[tuple[str, np.ndarray]]:
            for key in list(record.keys()):
                yield key, record.pop(key).numpy()

        fold.add_streamed(layout, decoded(), weight)

    def _is_echo(self, record: ArrayRecord) -> bool:
        return any(record is sent for sent in self._sent)

    def _arrays(self, message: Message) -> dict[str, np.ndarray]:
        """Decode a reply's model, emptying the reply as it goes.

        ``content[key]``, not ``content.array_records[key]``: the latter is a view that
        refers to itself, so the reply's arrays would outlive it until the cyclic GC ran.
        Popping each array as it is decoded keeps one array's bytes, not the model's,
        alongside the decoded copy (the aggregation benchmark measures this).
        """
        record = message.content[self.arrayrecord_key]
        if not isinstance(record, ArrayRecord):
            raise ValueError(f"reply's {self.arrayrecord_key!r} is not an ArrayRecord")
        if self._is_echo(record):  # an in-process party echoed what we sent: don't empty it
            return arrays_of(record)
        arrays: dict[str, np.ndarray] = {}
        for key in list(record.keys()):
            arrays[key] = record.pop(key).numpy()
        return arrays

    # -- collection

    def _collect_all(
        self, grid: Grid, messages: list[Message], timeout: float
    ) -> tuple[dict[int, Message], dict[int, float | None], dict[int, str]]:
        """Virtual clock: every reply comes back quickly; settle on reported times."""
        pushed = grid.push_messages(messages)
        ids = {mid: m.metadata.dst_node_id for mid, m in zip(pushed, messages, strict=True)}
        replies: dict[int, Message] = {}
        wall: dict[int, float] = {}
        started = time.monotonic()
        backoff = _Backoff(self.pull_interval_s)
        while len(replies) < len(ids) and time.monotonic() < started + timeout:
            got = list(grid.pull_messages([i for i in ids if ids[i] not in replies]))
            for reply in got:
                node = ids[reply.metadata.reply_to_message_id]
                replies[node] = reply
                wall[node] = time.monotonic() - started
            if len(replies) < len(ids):
                backoff.wait(progressed=bool(got))
        arrivals: dict[int, float | None] = {}
        failures: dict[int, str] = {}
        for node in ids.values():
            answer = replies.get(node)
            if answer is None:
                arrivals[node] = None
                failures[node] = f"no answer within {timeout}s"
            elif answer.has_error():
                arrivals[node] = None
                failures[node] = str(answer.error.reason or "")[:300]
            else:
                # A ClientApp that knows nothing of virtual time is timed on the wall.
                virtual = _virtual_time(answer)
                arrivals[node] = wall[node] if virtual is None else virtual
        return replies, arrivals, failures

    def _collect_streaming(
        self,
        server_round: int,
        grid: Grid,
        messages: list[Message],
        plan: deadlines.RoundPlan,
        timeout: float,
        folds: dict[str, StreamingMean],
    ) -> tuple[
        dict[int, Message],
        dict[int, float | None],
        dict[int, str],
        deadlines.Settlement,
    ]:
        """Wall clock: fold each reply into ``folds`` as it is pulled; stop at quorum or
        deadline."""
        started = time.monotonic()
        message_ids = list(grid.push_messages(messages))
        for mid, message in zip(message_ids, messages, strict=True):
            node = message.metadata.dst_node_id
            self._pending[mid] = (node, server_round, started, self.fold_group(node))
        replies: dict[int, Message] = {}
        arrivals: dict[int, float | None] = {}
        failures: dict[int, str] = {}
        on_time: list[int] = []
        limit = plan.deadline_s if plan.deadline_s is not None else timeout
        end = started + min(limit, timeout)
        this_round = set(message_ids)
        backoff = _Backoff(self.pull_interval_s)
        while True:
            now = time.monotonic()
            pulled = list(grid.pull_messages(list(self._pending)))
            for reply in pulled:
                node, origin, t0, group = self._pending.pop(reply.metadata.reply_to_message_id)
                if origin != server_round:  # a straggler from an earlier round
                    self._late_arrival(reply, origin, group)
                    continue
                arrivals[node] = now - t0
                if reply.has_error():
                    arrivals[node] = None
                    failures[node] = str(reply.error.reason or "")[:300]
                    continue
                try:
                    # Fold now, array by array, and let the reply go: memory stays at one
                    # model. A malformed reply (no or a bad weight, arrays that are not the
                    # model sent) is refused before anything is folded: a failed party.
                    self._fold_reply(folds.setdefault(group, StreamingMean()), reply)
                except ValueError as exc:
                    arrivals[node] = None
                    failures[node] = f"malformed reply: {exc}"[:300]
                    continue
                replies[node] = reply
                on_time.append(node)
            outstanding = [m for m in this_round if m in self._pending]
            # The round ends at its quorum, when nobody is left, or at the deadline.
            if len(on_time) >= plan.quorum or not outstanding or time.monotonic() >= end:
                break
            backoff.wait(progressed=bool(pulled))
        late = tuple(self._pending[m][0] for m in this_round if m in self._pending)
        if self.deadline.late_policy == "drop":
            for mid in [m for m in this_round if m in self._pending]:
                del self._pending[mid]  # replies to these ids are ignored when they come
        elapsed = time.monotonic() - started
        settlement = deadlines.Settlement(
            on_time=tuple(on_time),
            late=late,
            failed=tuple(n for n, t in arrivals.items() if t is None),
            round_time_s=elapsed,
            quorum_met=len(on_time) >= plan.quorum,
        )
        return replies, arrivals, failures, settlement

    def _late_arrival(self, reply: Message, origin_round: int, group: str) -> None:
        if reply.has_error() or self.deadline.late_policy != "stale":
            return
        self._late.append(_Late(self._arrays(reply), _weight(reply), origin_round, group))

    def _fold_late(self, folds: dict[str, StreamingMean], server_round: int) -> int:
        folded = 0
        for late in self._late:
            staleness = server_round - late.origin_round
            weight = late.weight * deadlines.staleness_weight(
                staleness, exponent=self.deadline.staleness_exponent
            )
            folds.setdefault(late.group, StreamingMean()).add(late.arrays, weight)
            folded += 1
        self._late.clear()
        return folded

    def _update_profiles(
        self,
        arrivals: dict[int, float | None],
        settlement: deadlines.Settlement,
        plan: deadlines.RoundPlan,
    ) -> None:
        for node, latency in arrivals.items():
            if latency is not None:
                self.profiles[node] = tiers.observe(self.profiles.get(node), latency)
        t_max = plan.deadline_s if plan.deadline_s is not None else settlement.round_time_s
        for node in settlement.failed:
            self.profiles[node] = tiers.observe_timeout(self.profiles.get(node), t_max)
        for node in settlement.late:
            if arrivals.get(node) is None:
                self.profiles[node] = tiers.observe_timeout(self.profiles.get(node), t_max)


class _Backoff:
    """Poll fast while replies are coming, then back off to ``ceiling_s``.

    A fixed interval costs up to a whole interval per round even when the replies are
    already there (in-process rounds take a few milliseconds); starting at 0.5 ms and
    doubling keeps idle polling cheap in a long deployment round.
    """

    def __init__(self, ceiling_s: float, floor_s: float = 0.0005) -> None:
        self.floor_s = min(floor_s, ceiling_s)
        self.ceiling_s = ceiling_s
        self.current_s = self.floor_s

    def wait(self, *, progressed: bool) -> None:
        if progressed:
            self.current_s = self.floor_s
        time.sleep(self.current_s)
        self.current_s = min(self.current_s * 2, self.ceiling_s)


def serialise(fold: StreamingMean) -> ArrayRecord:
    """The fold's mean as an ArrayRecord, one array at a time (no second full copy)."""
    record = ArrayRecord()
    for key, mean in fold.take_result():
        record[key] = Array(np.ascontiguousarray(mean))
        del mean
    return record


def _floats(record: MetricRecord) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}


def _weight(message: Message) -> float:
    metrics = message.content.metric_records
    for record in metrics.values():
        if NUM_EXAMPLES in record:
            value = record[NUM_EXAMPLES]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"'{NUM_EXAMPLES}' is not a number: {value!r}")
            weight = float(value)
            # A party's weight decides its share of the model: refuse what no party has.
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"'{NUM_EXAMPLES}' must be a finite number >= 0, got {value!r}")
            return weight
    raise ValueError(f"reply from node {message.metadata.src_node_id} has no '{NUM_EXAMPLES}'")


def _layout(record: ArrayRecord) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """Names, shapes and dtypes of a model's arrays, read without decoding them."""
    return {k: (tuple(a.shape), np.dtype(a.dtype)) for k, a in record.items()}


def _virtual_time(message: Message) -> float | None:
    for record in message.content.metric_records.values():
        if VIRTUAL_TIME_KEY in record:
            return float(record[VIRTUAL_TIME_KEY])  # type: ignore[arg-type]
    return None


def _weighted_metrics(replies: list[Message]) -> dict[str, float]:
    totals: dict[str, float] = {}
    weight_sum = 0.0
    for reply in replies:
        weight = _weight(reply)
        weight_sum += weight
        for record in reply.content.metric_records.values():
            for key, value in record.items():
                if isinstance(value, int | float) and key != NUM_EXAMPLES and math.isfinite(value):
                    totals[key] = totals.get(key, 0.0) + weight * float(value)
    return {k: v / weight_sum for k, v in totals.items()} if weight_sum else {}

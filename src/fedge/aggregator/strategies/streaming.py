"""The round every fedge strategy shares: FedAvg with streaming folds, deadlines and quorum.

Flower's ``Strategy.start`` sends a round's messages and waits for every reply before
aggregating (``grid.send_and_receive``): one straggler decides the round's length and all
replies sit in memory at once. :meth:`StreamingFedAvg.start` keeps Flower's contract --
``configure_train`` builds the messages, replies are Flower ``Message``s, an error reply is
a failure -- and changes the waiting (the collect loops, :mod:`fedge.aggregator.rounds.collect`):

- replies are pulled as they arrive and folded into a running weighted mean (memory: one
  model, not one per party);
- a round ends at its k-of-n quorum or its deadline, whichever comes first (see
  :mod:`fedge.aggregator.rounds.deadline`); parties still working are *late*, errors *failed*;
  both are recorded, never waited on;
- late replies are dropped or folded into a later round with a staleness weight
  (FedBuff, Nguyen et al., AISTATS'22), by configuration;
- the folded mean becomes the new model, or -- with a server optimizer (``server_opt``:
  FedAdam, FedYogi, FedAdagrad, FedAvgM; :mod:`fedge.aggregator.strategies.server_opt`) --
  a pseudo-gradient step from the model sent (:meth:`StreamingFedAvg.server_update`).

In simulation the clock is virtual: replies come back at once and carry the time their
work would have taken (``virtual-time-s``), so they are settled in virtual arrival order
(deterministic for a seed). Any Flower ClientApp works: without a virtual time, the wall
time from push to pull is the party's latency.

Flower's own ``Strategy.start`` works too: :meth:`StreamingFedAvg.aggregate_train`
settles the round Flower collected exactly as the virtual-clock loop does
(:mod:`fedge.aggregator.rounds.settled`), so both loops give the same models for a seed. Late
replies are held and folded by :mod:`fedge.aggregator.rounds.stale`.
"""

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from fedge.aggregator.rounds import deadline as deadlines
from fedge.aggregator.rounds import latency, stale
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.collect import ReplyStream, collect_all
from fedge.aggregator.rounds.deadline import DeadlineConfig
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.loop import CheckpointFn, EvaluateFn, RoundOutcome, run_rounds
from fedge.aggregator.rounds.record import RoundObserver, RoundRecord, settled_record, summary
from fedge.aggregator.rounds.replies import (
    Collected,
    arrays_of,
    fold_reply,
    to_array_record,
    weighted_metrics,
)
from fedge.aggregator.rounds.settled import Configured, flower_collected, settle_all
from fedge.aggregator.strategies import server_opt as opt
from fedge.aggregator.strategies.hooks import RoundHooks
from fedge.privacy.settings import PrivacyMode, PrivacySpec

_Late = stale.LateReply  # the name held replies had here (tests build them directly)


class StreamingFedAvg(RoundHooks, FedAvg):
    """FedAvg (McMahan et al., 2017) with streaming folds, deadlines and quorum.

    ``per_round`` parties are sampled uniformly per round (the baseline TiFL compares
    against); subclasses override the hooks
    (:class:`~fedge.aggregator.strategies.hooks.RoundHooks`),
    e.g. :meth:`candidates` and :meth:`expected_latency` to change who is asked and how
    long to wait.
    """

    def __init__(
        self,
        *,
        per_round: int,
        seed: int = 0,
        clock: ClockMode = ClockMode.WALL,
        deadline: DeadlineConfig | None = None,
        pull_interval_s: float = 0.01,
        server_opt: opt.ServerOptConfig | None = None,
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
        self.profiles: dict[int, latency.LatencyProfile] = {}
        self.elapsed_s = 0.0
        self.observers: list[RoundObserver] = []
        # Called with each round's record and its on-time replies (e.g. per-party metrics).
        self.reply_observers: list[Callable[[RoundRecord, dict[int, Message]], None]] = []
        self._late: list[stale.LateReply] = []
        self._sent: tuple[ArrayRecord, ...] = ()  # the model(s) sent this round
        self._stream = ReplyStream()  # wall clock: replies still awaited
        self._configured: Configured | None = None  # what configure_train planned
        # Privacy (fedge.privacy.settings): sent to every party in the round config. A party
        # that refused for its privacy budget is never asked again (its ledger, where the
        # data is, would refuse every later round too).
        self.privacy = PrivacySpec()
        self.job_id = ""
        self.exhausted: set[int] = set()
        # Central DP (fedge.aggregator.privacy.central_dp): each released round's effective noise
        # multiplier, kept in checkpoints so a resumed job accounts what it really spent.
        self.central_releases: dict[int, float] = {}
        # The server optimizer (None: FedAvg's mean is the model) and its moments, which
        # checkpoints keep (server_opt_arrays). Central DP defers the step until after its
        # noise (``server_opt_deferred``): the optimizer sees only the released aggregate.
        self.server_opt = server_opt
        self.server_opt_state = opt.ServerOptState()
        self.server_opt_deferred = False

    # -- state for checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "elapsed_s": self.elapsed_s,
            "profiles": {str(k): dataclasses.asdict(v) for k, v in self.profiles.items()},
            "exhausted": sorted(self.exhausted),
            "central_releases": {str(k): v for k, v in sorted(self.central_releases.items())},
            "server_opt": None
            if self.server_opt is None
            else {"name": self.server_opt.name, "step": self.server_opt_state.step},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.elapsed_s = float(state["elapsed_s"])
        self.profiles = {int(k): latency.LatencyProfile(**v) for k, v in state["profiles"].items()}
        self.exhausted = {int(n) for n in state.get("exhausted", [])}
        releases = state.get("central_releases", {})
        self.central_releases = {int(k): float(v) for k, v in releases.items()}
        saved = state.get("server_opt")
        if saved is not None and self.server_opt is None:
            raise ValueError(
                f"the checkpoint was written with server_opt {saved['name']!r}; the strategy "
                "has none: give the job its server_opt again"
            )
        if saved is not None and self.server_opt is not None:
            if saved["name"] != self.server_opt.name:
                raise ValueError(
                    f"the checkpoint's server optimizer is {saved['name']!r}, the strategy's "
                    f"{self.server_opt.name!r}: its moments mean something else"
                )
            # The moments follow (restore_server_opt_arrays); until then, only the steps.
            self.server_opt_state = opt.ServerOptState(step=int(saved["step"]))
        else:
            self.server_opt_state = opt.ServerOptState()

    def server_opt_arrays(self) -> dict[str, dict[str, np.ndarray]]:
        """The server optimizer's moments (whole models), kept in checkpoints as arrays."""
        if self.server_opt is None:
            return {}
        return self.server_opt_state.arrays()

    def restore_server_opt_arrays(self, arrays: dict[str, dict[str, np.ndarray]]) -> None:
        """Take back :meth:`server_opt_arrays` (after :meth:`load_state_dict`)."""
        if self.server_opt is None:
            if any(arrays.values()):
                raise ValueError("the checkpoint holds server optimizer moments; no server_opt")
            return
        self.server_opt_state = opt.ServerOptState.restored(self.server_opt_state.step, arrays)

    def late_replies(self) -> list[stale.HeldTuple]:
        """Late replies held for staleness folding: (arrays, weight, origin round, group).

        Kept out of :meth:`state_dict` because they are whole models: checkpoints store
        them as arrays beside the JSON state.
        """
        return stale.as_tuples(self._late)

    def restore_late_replies(self, replies: Iterable[stale.HeldTuple]) -> None:
        self._late = stale.from_tuples(replies)

    # -- Flower's contract: configure, then aggregate what Flower's start() collected

    def plan(self, server_round: int, grid: Grid) -> tuple[deadlines.RoundPlan, int | None]:
        node_ids = self.trainable(grid)
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

    def trainable(self, grid: Grid) -> list[int]:
        """The grid's nodes that may still train (not out of privacy budget)."""
        return [n for n in sorted(grid.get_node_ids()) if n not in self.exhausted]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        plan, tier = self.plan(server_round, grid)
        messages = self._messages(server_round, arrays, config, plan)
        self._configured = Configured(server_round, arrays, plan, tier, time.time())
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Settle and fold a round whose replies Flower's ``Strategy.start`` collected.

        The same settlement as the virtual-clock loop (:meth:`run_round`): a party's
        latency is its ``virtual-time-s``, else the wall time from ``configure_train`` to
        its reply's creation; replies past the deadline are late (dropped or held for
        staleness folding), errors and malformed replies failed, missing ones failed too.
        Latency profiles, tier accuracies and observers are updated as in our loop.
        """
        configured = self._configured
        if configured is None or configured.server_round != server_round:
            raise ValueError(
                f"aggregate_train(round {server_round}) without configure_train for that "
                "round: call configure_train first, as Strategy.start does"
            )
        self._configured = None
        collected = flower_collected(configured, replies)
        arrays, record = self._settle(
            server_round, configured.arrays, configured.plan, configured.tier, collected
        )
        for observer in self.observers:
            observer(record)
        metrics = MetricRecord(dict(record.train_metrics)) if record.train_metrics else None
        return arrays, metrics

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
        if self.privacy.mode is not PrivacyMode.NONE:
            for key, value in self.privacy.to_config().items():
                round_config[key] = value
            if self.job_id:
                round_config["job-id"] = self.job_id
        for key, value in self.round_config(server_round, plan).items():
            round_config[key] = value
        return round_config

    # -- our loop

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        *,
        first_round: int = 1,
        checkpoint_fn: CheckpointFn | None = None,
    ) -> Result:
        """Run rounds ``first_round..num_rounds`` (a resumed job starts past round 1) in
        the one round loop (:func:`~fedge.aggregator.rounds.loop.run_rounds`)."""
        config = train_config or ConfigRecord()
        self.plan_privacy(num_rounds)

        def play(server_round: int, arrays: ArrayRecord) -> RoundOutcome | None:
            if not self.can_train(server_round, grid):
                return None
            return RoundOutcome.of(*self.run_round(server_round, arrays, config, grid, timeout))

        return run_rounds(
            play,
            initial_arrays,
            num_rounds=num_rounds,
            first_round=first_round,
            observers=self.observers,
            evaluate_fn=evaluate_fn,
            checkpoint_fn=checkpoint_fn,
        )

    def can_train(self, server_round: int, grid: Grid) -> bool:
        """Whether any party may train in ``server_round`` (else the run stops, logged)."""
        if self.trainable(grid):
            return True
        if not list(grid.get_node_ids()):
            log(INFO, "round %d: no party is connected; stopping", server_round)
        else:
            log(INFO, "round %d: every party is out of privacy budget; stopping", server_round)
        return False

    def plan_privacy(self, num_rounds: int) -> None:
        """DP-SGD without a planned participation plans for every round of the job."""
        if self.privacy.mode is PrivacyMode.LOCAL and self.privacy.rounds_per_party is None:
            self.privacy = dataclasses.replace(self.privacy, rounds_per_party=num_rounds)

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
        if self.clock is ClockMode.VIRTUAL:
            collected = collect_all(grid, messages, timeout, self.pull_interval_s)
            return self._settle(server_round, arrays, plan, tier, collected)
        folds: dict[str, StreamingMean] = {}

        def fold(group: str, reply: Message) -> None:
            fold_reply(
                folds.setdefault(group, StreamingMean()),
                reply,
                self.arrayrecord_key,
                self._sent,
                self._echoes(),
            )

        collected, settlement = self._stream.collect(
            server_round,
            grid,
            messages,
            plan,
            timeout,
            groups={n: self.fold_group(n) for n in plan.selected},
            fold=fold,
            straggler=self._late_arrival,
            keep_late=self.deadline.late_policy == "stale",
            pull_interval_s=self.pull_interval_s,
        )
        stale_folded = self._fold_late(folds, server_round)
        return self.close_round(
            server_round, arrays, plan, tier, folds, settlement, collected, stale_folded
        )

    def _settle(
        self,
        server_round: int,
        arrays: ArrayRecord,
        plan: deadlines.RoundPlan,
        tier: int | None,
        collected: Collected,
    ) -> tuple[ArrayRecord, RoundRecord]:
        """A round whose replies are all in (virtual clock, Flower's ``start``): settle on
        arrival times, then fold, after the late replies of earlier rounds."""
        folds: dict[str, StreamingMean] = {}
        stale_folded = self._fold_late(folds, server_round)
        settlement, held = settle_all(
            plan,
            collected,
            folds,
            server_round=server_round,
            key=self.arrayrecord_key,
            sent=self._sent,
            echoes=self._echoes(),
            fold_group=self.fold_group,
            keep_late=self.deadline.late_policy == "stale",
        )
        self._late.extend(held)
        return self.close_round(
            server_round, arrays, plan, tier, folds, settlement, collected, stale_folded
        )

    def close_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        plan: deadlines.RoundPlan,
        tier: int | None,
        folds: dict[str, StreamingMean],
        settlement: deadlines.Settlement,
        collected: Collected,
        stale_folded: int,
    ) -> tuple[ArrayRecord, RoundRecord]:
        """What every round ends with, whatever it folded: the new model, profiles, clock,
        record, hooks."""
        replies = collected.replies
        self.exhausted |= collected.exhausted
        on_time_replies = {n: replies[n] for n in settlement.on_time if n in replies}
        metrics = weighted_metrics(list(on_time_replies.values()))
        # Before aggregate(), which may consume the folds.
        folded = any(fold.count and fold.total_weight > 0 for fold in folds.values())
        new_arrays = self.aggregate(server_round, arrays, folds, metrics)
        if folded and not self.server_opt_deferred:
            new_arrays = self.server_update(arrays, new_arrays)
        latency.observe_round(self.profiles, collected.arrivals, settlement, plan.deadline_s)
        self.elapsed_s += settlement.round_time_s
        record = settled_record(
            server_round,
            plan,
            settlement,
            tier=tier,
            elapsed_s=self.elapsed_s,
            stale_folded=stale_folded,
            train_metrics=metrics,
            failures=collected.failures,
        )
        log(INFO, "%s", summary(record))
        self.after_round(record, on_time_replies)
        for observer in self.reply_observers:
            observer(record, on_time_replies)
        return new_arrays, record

    def server_update(self, sent: ArrayRecord, mean: ArrayRecord) -> ArrayRecord:
        """The new global model from the model ``sent`` and the round's ``mean``: the mean
        itself (FedAvg), or the server optimizer's step on ``sent - mean`` (FedOpt), which
        then advances its state. Called once per round that produced a mean."""
        if self.server_opt is None:
            return mean
        new, self.server_opt_state = opt.server_step(
            self.server_opt, self.server_opt_state, arrays_of(sent), arrays_of(mean)
        )
        return to_array_record({key: new[key] for key in mean})

    # -- replies

    def _echoes(self) -> Sequence[ArrayRecord]:
        """Models we sent that an in-process party may hand back as is (never emptied)."""
        return self._sent

    def _late_arrival(self, reply: Message, origin_round: int, group: str) -> None:
        """A straggler of an earlier round, pulled by the wall-clock loop: held or dropped."""
        if reply.has_error() or self.deadline.late_policy != "stale":
            return
        self._late.append(
            stale.hold(reply, self.arrayrecord_key, self._echoes(), origin_round, group)
        )

    def _fold_late(self, folds: dict[str, StreamingMean], server_round: int) -> int:
        """Fold (and let go) the late replies held from earlier rounds."""
        exponent = self.deadline.staleness_exponent
        folded = stale.fold_stale(self._late, folds, server_round, exponent=exponent)
        self._late.clear()
        return folded

"""Central DP: Flower's server-side clipping wrapper composed with our strategies.

McMahan et al. (ICLR 2018, "Learning differentially private recurrent language models"):
the server clips every party's update (its model minus the one sent) to ``C`` and adds
Gaussian noise of standard deviation ``sigma * C / n`` to the mean of ``n`` updates. One
station changes that mean by at most ``C / n``, so a round is a Gaussian mechanism with
noise multiplier ``sigma`` at the *station* level. We account it with the RDP accountant
without amplification by sampling (tier selection is not the uniform Poisson sampling the
amplification theorem needs), composed over the rounds released -- an upper bound for
every station, which trains in at most that many rounds.

Flower's :class:`DifferentialPrivacyServerSideFixedClipping` does the clipping and the
noise; it drives our strategy through Flower's ``Strategy`` contract, which our strategies
honour (``aggregate_train`` settles a round as our loop does). What the bound needs:

- every update counts the same (the sensitivity is ``C / k`` only for an unweighted mean
  of ``k``), so the replies' ``num-examples`` are set to 1 before our strategy folds them;
- no reply is folded twice and no deadline cuts the mean (:func:`check_strategy`);
- the noise is sized for the ``n`` parties asked; when only ``k < n`` updates were folded
  (a party missing, a malformed reply) the mean's sensitivity is ``C / k`` and the round's
  *effective* noise multiplier is ``sigma * k / n``: that is what each round is accounted
  at (:class:`DpRelease` of that sigma, composed by :func:`epsilon_spent`);
- a round with an error reply is skipped by Flower's wrapper: our strategy still settles it
  (failures recorded, latencies profiled) but nothing is released or accounted;
- a job's ``privacy.epsilon`` is its bound: too many rounds are refused before training
  (:func:`check_rounds`), and a round whose release would pass it is never released.

With a server optimizer (``server_opt``, :mod:`fedge.aggregator.strategies.server_opt`)
the step is taken on the *noised* aggregate, after Flower's wrapper added its noise and
only for a released round: post-processing of a DP release costs no extra epsilon
(Dwork and Roth, 2014, Prop. 2.1). The strategy's own step is deferred
(``server_opt_deferred``) so the optimizer never sees the clean mean.

Each round's record carries ``dp-epsilon-station`` (the epsilon accounted so far),
``dp-released`` and ``dp-noise-multiplier-effective`` in its ``train_metrics`` before any
observer (the run store) sees it.
"""

import dataclasses
import math
from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, Result
from flwr.supercore import log

from fedge.aggregator.jobs.run_store import RELEASED_KEY, STATION_EPSILON_KEY
from fedge.aggregator.rounds.loop import CheckpointFn, EvaluateFn, RoundOutcome, run_rounds
from fedge.aggregator.rounds.record import RoundRecord
from fedge.aggregator.rounds.replies import NUM_EXAMPLES, layout
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.aggregator.strategies.tiered import TieredFedAvg
from fedge.privacy.accounting import epsilon_spent
from fedge.privacy.settings import DpRelease, PrivacyError, PrivacyMode, PrivacySpec

EFFECTIVE_SIGMA_KEY = "dp-noise-multiplier-effective"
_SLACK = 1e-9  # float noise in composing the same releases twice


class CentralDP(DifferentialPrivacyServerSideFixedClipping):
    """Flower's server-side fixed clipping over a fedge strategy, accounted per round."""

    def __init__(self, strategy: StreamingFedAvg) -> None:
        spec = strategy.privacy
        check_strategy(strategy)
        assert spec.noise_multiplier is not None  # PrivacySpec requires it for central
        # Federated evaluation would send every party the model each round; the job's own
        # evaluation (evaluate_fn) is what reports accuracy.
        strategy.fraction_evaluate = 0.0
        # The server optimizer steps on the noised release, here, not on the clean mean.
        strategy.server_opt_deferred = True
        super().__init__(strategy, spec.noise_multiplier, spec.clipping_norm, strategy.per_round)
        self.spec = spec
        self.inner = strategy
        # Released rounds and their effective sigmas live on the strategy, so they are in
        # its checkpoints (a resumed job accounts what was really spent).
        self.releases = strategy.central_releases
        self.epsilon_by_round: dict[int, float] = {}
        self.stopped = ""  # why the job stopped before its last round (its bound)

    @property
    def released(self) -> int:
        """Rounds whose noised aggregate was released."""
        return len(self.releases)

    def epsilon(self, *extra_sigmas: float) -> float:
        """Station epsilon of the released rounds (plus ``extra_sigmas`` releases)."""
        sigmas = [*self.releases.values(), *extra_sigmas]
        history = [DpRelease(noise_multiplier=s, sample_rate=1.0, steps=1) for s in sigmas]
        return epsilon_spent(history, self.spec.delta, self.spec.accountant)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The noise is sized for the parties this round asks (TiFL's profiling round asks
        everyone, a tier round ``per_round``): sigma * C / n on their mean."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.num_sampled_clients = max(1, len(messages))
        return messages

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
        """Flower's round (configure, send and wait for all, aggregate) in the one round
        loop (:func:`~fedge.aggregator.rounds.loop.run_rounds`), resumable like ours.

        A resumed job accounts the releases its checkpoint holds; a checkpoint from before
        they were kept counts every earlier round as released at the full sigma.
        """
        config = train_config or ConfigRecord()
        for earlier in [r for r in self.releases if r >= first_round]:
            del self.releases[earlier]  # replayed rounds are accounted again
        if first_round > 1 and not self.releases:
            assert self.spec.noise_multiplier is not None
            self.releases.update(dict.fromkeys(range(1, first_round), self.spec.noise_multiplier))
        # aggregate_train hands our strategy's record on with the DP keys; hold it until
        # the loop has evaluated the round, as our own loop reports a round with its
        # evaluation.
        observers, held = self.inner.observers, list[RoundRecord]()

        def play(server_round: int, arrays: ArrayRecord) -> RoundOutcome | None:
            if self._out_of_budget(server_round):
                return None
            messages = self.configure_train(server_round, arrays, config, grid)
            replies = grid.send_and_receive(messages, timeout=timeout)
            new_arrays, metrics = self.aggregate_train(server_round, replies)
            (record,) = held
            held.clear()
            # Nothing released: the model stays as it was.
            kept = arrays if new_arrays is None else new_arrays
            return RoundOutcome(kept, record, metrics, last=bool(self.stopped))

        self.inner.observers = [held.append]
        try:
            return run_rounds(
                play,
                initial_arrays,
                num_rounds=num_rounds,
                first_round=first_round,
                observers=observers,
                evaluate_fn=evaluate_fn,
                checkpoint_fn=checkpoint_fn,
            )
        finally:
            self.inner.observers = observers

    def _out_of_budget(self, server_round: int) -> bool:
        """Whether even a full-sigma release this round would pass ``privacy.epsilon``."""
        bound = self.spec.epsilon
        if bound is None or self.spec.noise_multiplier is None:
            return False
        cost = self.epsilon(self.spec.noise_multiplier)
        if cost <= bound + _SLACK:
            return False
        self.stopped = (
            f"round {server_round} would take the station epsilon from {self.epsilon():.4f} "
            f"to {cost:.4f}, past privacy.epsilon = {bound:g}"
        )
        log(WARNING, "central DP: stopping: %s", self.stopped)
        return True

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        unclippable = self._unclippable(replies)
        kept = [r for r in replies if r.metadata.src_node_id not in unclippable]
        errors = [r for r in kept if r.has_error()]
        records: list[RoundRecord] = []
        observers, self.inner.observers = self.inner.observers, [records.append]
        try:
            if errors:
                # Flower's wrapper skips the round; our strategy still settles it so the
                # failures are recorded and the latencies profiled. Its model is dropped.
                self.inner.aggregate_train(server_round, kept)
                arrays: ArrayRecord | None = None
                metrics: MetricRecord | None = None
            else:
                for reply in kept:
                    for reported in reply.content.metric_records.values():
                        if NUM_EXAMPLES in reported:
                            reported[NUM_EXAMPLES] = 1
                arrays, metrics = super().aggregate_train(server_round, kept)
        finally:
            self.inner.observers = observers
        (record,) = records
        if unclippable:
            record = dataclasses.replace(record, failures={**record.failures, **unclippable})
        folded, asked = len(record.on_time), self.num_sampled_clients
        sigma = self.spec.noise_multiplier
        assert sigma is not None
        effective = sigma if folded == asked else sigma * folded / asked
        withheld = ""
        if errors:
            withheld = (
                f"{len(errors)} of {asked} parties replied with an error "
                f"({', '.join(str(r.metadata.src_node_id) for r in errors)}): Flower's "
                "central DP skips the round"
            )
        elif arrays is not None and folded == 0:
            withheld = "no update was folded"
        elif arrays is not None and self.spec.epsilon is not None:
            cost = self.epsilon(effective)
            if cost > self.spec.epsilon + _SLACK:
                withheld = (
                    f"only {folded} of {asked} updates were folded (effective noise "
                    f"multiplier {effective:.4g}): releasing would spend epsilon {cost:.4f}, "
                    f"past privacy.epsilon = {self.spec.epsilon:g}"
                )
                self.stopped = withheld
        if withheld or arrays is None:
            arrays = None
            log(INFO, "central DP round %d: nothing released (%s)", server_round, withheld)
        else:
            self.releases[server_round] = effective
            # Post-processing of the release (no extra epsilon): FedOpt's step, if any.
            arrays = self.inner.server_update(self.current_arrays, arrays)
            if folded < asked:
                log(
                    WARNING,
                    "central DP round %d: %d of %d updates folded; accounted at noise "
                    "multiplier %.4g instead of %.4g",
                    server_round,
                    folded,
                    asked,
                    effective,
                    sigma,
                )
        released = arrays is not None
        epsilon = self.epsilon()
        if released:
            self.epsilon_by_round[server_round] = epsilon
        dp_metrics = {
            STATION_EPSILON_KEY: epsilon,
            RELEASED_KEY: float(released),
            EFFECTIVE_SIGMA_KEY: effective if released else 0.0,
        }
        record = dataclasses.replace(record, train_metrics={**record.train_metrics, **dp_metrics})
        for observer in observers:
            observer(record)
        return arrays, MetricRecord({**dict(metrics or {}), **dp_metrics})

    def _unclippable(self, replies: list[Message]) -> dict[int, str]:
        """Replies Flower's clipping cannot subtract from the model sent: left out of the
        round (their party failed), so a malformed reply never stops it."""
        expected = layout(self.current_arrays)
        key = self.inner.arrayrecord_key
        reasons: dict[int, str] = {}
        for reply in replies:
            if reply.has_error():
                continue
            records = reply.content.array_records
            if key not in records or any(layout(r) != expected for r in records.values()):
                reasons[reply.metadata.src_node_id] = (
                    "malformed reply: its arrays are not the model that was sent "
                    "(names or shapes); central DP cannot clip it"
                )
        return reasons


def check_strategy(strategy: StreamingFedAvg) -> None:
    """Central DP's bound holds only if every selected party is folded once, unweighted."""
    spec = strategy.privacy
    if spec.mode is not PrivacyMode.CENTRAL:
        raise PrivacyError(f"central DP needs privacy.mode = 'central', got {spec.mode.value!r}")
    deadline = strategy.deadline
    if deadline.deadline_factor or deadline.over_selection or deadline.quorum_fraction < 1:
        raise PrivacyError(
            "privacy.mode = 'central' needs every selected party in each mean (its noise is "
            "sized for per_round updates): remove deadline_factor, over_selection and "
            "quorum_fraction from the strategy"
        )
    if deadline.late_policy == "stale":
        raise PrivacyError(
            "privacy.mode = 'central' cannot fold late replies into a later round "
            "(late_policy = 'stale'): a station's update in two rounds' means doubles its "
            "sensitivity; remove late_policy"
        )
    if isinstance(strategy, TieredFedAvg) and strategy.profiling_deadline_s is not None:
        raise PrivacyError(
            "privacy.mode = 'central' needs every party of TiFL's profiling round in its "
            "mean: a profiling_deadline_s would cut it short; remove profiling_deadline_s"
        )


def station_epsilon(spec: PrivacySpec, rounds: int) -> float:
    """Station-level epsilon after ``rounds`` full-sigma releases (no sampling
    amplification): the plan; what a job spent is :meth:`CentralDP.epsilon`."""
    if rounds < 1:
        return 0.0
    assert spec.noise_multiplier is not None
    release = DpRelease(noise_multiplier=spec.noise_multiplier, sample_rate=1.0, steps=rounds)
    return epsilon_spent([release], spec.delta, spec.accountant)


def check_rounds(spec: PrivacySpec, rounds: int) -> None:
    """Refuse, before any training, a central-DP job whose rounds would pass its epsilon."""
    bound = spec.epsilon
    if spec.mode is not PrivacyMode.CENTRAL or bound is None:
        return
    assert spec.noise_multiplier is not None
    cost = station_epsilon(spec, rounds)
    if cost <= bound + _SLACK:
        return
    affordable = 0
    while affordable < rounds and station_epsilon(spec, affordable + 1) <= bound + _SLACK:
        affordable += 1
    raise PrivacyError(
        f"central DP: {rounds} rounds at privacy.noise_multiplier = "
        f"{spec.noise_multiplier:g} would spend a station epsilon of {cost:.3f} (delta "
        f"{spec.delta:g}), past privacy.epsilon = {bound:g}: run at most {affordable} "
        f"rounds, or raise privacy.noise_multiplier to {_sigma_for(spec, rounds):g} or more"
    )


def _sigma_for(spec: PrivacySpec, rounds: int) -> float:
    """The smallest noise multiplier (to 0.1%) whose ``rounds`` releases stay in budget."""
    assert spec.epsilon is not None and spec.noise_multiplier is not None
    low, high = spec.noise_multiplier, spec.noise_multiplier * 2

    def cost(sigma: float) -> float:
        return station_epsilon(dataclasses.replace(spec, noise_multiplier=sigma), rounds)

    while cost(high) > spec.epsilon:
        low, high = high, high * 2
    while high - low > high * 1e-3:
        middle = (low + high) / 2
        low, high = (middle, high) if cost(middle) > spec.epsilon else (low, middle)
    return math.ceil(high * 1000) / 1000

"""Secure aggregation: Flower's SecAgg+ rounds, planned and recorded by our strategies.

The protocol is Flower's (``SecAggPlusWorkflow``; Bell et al., "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead", CCS 2020): every party adds pairwise and
private masks to its quantised update, and the server only ever learns their sum. We
write no cryptography. What we add is the round around it
(:mod:`fedge.aggregator.privacy.secagg_round`): our strategy -- plain FedAvg or TiFL's tiers --
chooses who is asked, our deadline planning sets how long the masked-vector stage may
take, and the unmasked mean becomes the round's model and record exactly as in our own
loop (latency profiles, tier accuracies, observers, run store).

:func:`run_secagg` runs N such rounds over any Flower ``Grid``: the simulation runtime's
or a SuperLink's; a deployed ServerApp and the simulator call the same function. The
parties run :func:`fedge.party.secagg.secagg_mod` in front of their ClientApp.

Error, dropout and quantisation:

* A party that fails at any stage is a dropout; while at least the reconstruction
  threshold of each party's neighbours survives, SecAgg+ still recovers the aggregate of
  the others. Below it the round is lost (the model stays, every party is recorded as
  failed) but the run goes on.
* The round's deadline applies at the masked-vector stage, on the wall clock and on the
  virtual one (issue 32): a party past it is recorded *late* and is a dropout to the
  protocol (its vector is not summed). Late replies cannot be kept for a later round, so
  ``late_policy = "stale"`` is refused.
* A party that dies silently (SIGKILL, power cut) sends nothing, and Flower 1.41's
  SuperLink reports it (an error reply, "node unavailable") only once its heartbeat
  expires, 37.5-60 s after the death (patience 2 x the SuperNode's 30 s interval). So
  every stage waits on our own clock (:class:`~fedge.aggregator.rounds.collect.PolledGrid`):
  a key stage at most ``key_stage_timeout_s``, the masked-vector stage at most the round's
  deadline (else ``timeout``), each plus one pull interval and one pull. A party killed
  after the key stages and before its masked vector makes the round last at most the
  masked-vector stage's limit plus the other three stages (which do not wait for it: it
  is no longer asked), and it is recorded failed ("no answer within T s") -- or late
  when a deadline applied. The bound is the stages' limits, never Flower's expiry, as
  long as those limits are shorter; with longer ones Flower's reply ends the wait first.
* Never fewer than three (:data:`SECAGG_MIN_PARTIES`, issue 24): the sum of two updates
  is no secret from either party, who subtracts its own. A round asks at least three
  parties, TiFL's tiers under SecAgg+ hold at least three, the reconstruction threshold
  is at least three (a share resolving to fewer is raised to three; a count below three
  is refused), and a round whose masked vectors came from fewer than three parties is
  abandoned before anything is unmasked.
* The server is assumed honest-but-curious: it follows the protocol (it could otherwise
  claim parties dropped and collect both of an honest party's secrets; SecAgg+'s
  malicious-server variant, with consistency checks and signatures, is not Flower's).
* SecAgg+ quantises: each party scales its update by its weight ``n / max_weight``,
  clips it to ``[-clipping_range, clipping_range]`` and rounds it stochastically onto
  ``quantization_range`` levels. :func:`quantization_error_bound` is the largest
  difference from the plain weighted mean that this allows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from fedge.aggregator.fleet.identity import IdentifiedGrid
from fedge.aggregator.privacy.secagg_round import NodeMap, SecAggRound, StageRecorder
from fedge.aggregator.rounds.collect import PolledGrid
from fedge.aggregator.rounds.loop import CheckpointFn, EvaluateFn, RoundOutcome, run_rounds
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.aggregator.strategies.tiered import TieredFedAvg
from fedge.privacy.settings import SECAGG_MIN_PARTIES, PrivacyError, PrivacySpec

DEFAULT_MAX_WEIGHT = 1000.0  # Flower's default: a party's num-examples is scaled by this
DEFAULT_MODULUS_RANGE = 2**32
DEFAULT_KEY_STAGE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SecAggSettings:
    """SecAgg+'s parameters for a job (from its ``[privacy]``: :meth:`from_privacy`)."""

    reconstruction_threshold: float = 0.5
    """A share of each party's neighbours in (0, 1], or a count >= 3 (PrivacySpec's); the
    round's count is :meth:`round_threshold`, never below 3."""
    clipping_range: float = 8.0
    quantization_range: int = 4_194_304
    num_shares: float = 1.0
    """Neighbours per party as a share of the round's parties (1.0: everyone, SecAgg)."""
    max_weight: float = DEFAULT_MAX_WEIGHT
    """At least the largest ``num-examples`` a party reports, or its update is clipped."""
    modulus_range: int = DEFAULT_MODULUS_RANGE
    key_stage_timeout_s: float = DEFAULT_KEY_STAGE_TIMEOUT_S
    """Wall seconds each key stage (setup, share keys, unmask) waits for replies."""

    def __post_init__(self) -> None:
        threshold = self.reconstruction_threshold
        if not math.isfinite(threshold) or threshold <= 0 or 1 < threshold < SECAGG_MIN_PARTIES:
            raise PrivacyError(
                f"SecAgg+ reconstruction threshold must be a share in (0, 1] or a count "
                f">= {SECAGG_MIN_PARTIES} (fewer parties could unmask one another), "
                f"got {threshold}"
            )
        if threshold > 1 and threshold != int(threshold):
            raise PrivacyError(f"SecAgg+ threshold as a count must be whole, got {threshold}")
        if not 0 < self.num_shares <= 1:
            raise PrivacyError(
                f"SecAgg+ num_shares must be a share in (0, 1], got {self.num_shares}"
            )
        if not (math.isfinite(self.clipping_range) and self.clipping_range > 0):
            raise PrivacyError(f"SecAgg+ clipping range must be > 0, got {self.clipping_range}")
        if self.quantization_range < 2:
            raise PrivacyError(
                f"SecAgg+ quantization range must be >= 2, got {self.quantization_range}"
            )
        if not (math.isfinite(self.max_weight) and self.max_weight > 0):
            raise PrivacyError(f"SecAgg+ max_weight must be > 0, got {self.max_weight}")
        modulus = self.modulus_range
        if modulus <= self.quantization_range or modulus & (modulus - 1) or modulus > 2**32:
            raise PrivacyError(
                "SecAgg+ modulus range must be a power of 2 above the quantization range "
                f"and at most 2**32, got {modulus}"
            )
        if not (math.isfinite(self.key_stage_timeout_s) and self.key_stage_timeout_s > 0):
            raise PrivacyError(
                f"SecAgg+ key stage timeout must be > 0 s, got {self.key_stage_timeout_s}"
            )

    @classmethod
    def from_privacy(
        cls,
        spec: PrivacySpec,
        *,
        max_weight: float = DEFAULT_MAX_WEIGHT,
        key_stage_timeout_s: float = DEFAULT_KEY_STAGE_TIMEOUT_S,
    ) -> SecAggSettings:
        if not spec.secagg:
            raise PrivacyError("privacy.secagg is off: this job does not run SecAgg+")
        return cls(
            reconstruction_threshold=spec.secagg_threshold,
            clipping_range=spec.secagg_clipping_range,
            quantization_range=spec.secagg_quantization_range,
            max_weight=max_weight,
            key_stage_timeout_s=key_stage_timeout_s,
        )

    @property
    def threshold_count(self) -> int | None:
        """The threshold as a count of parties (None: a share of each round's)."""
        threshold = self.reconstruction_threshold
        return int(threshold) if threshold > 1 else None

    def round_threshold(self, selected: int) -> int:
        """The reconstruction threshold of a round of ``selected`` parties, as a count.

        A share resolves as Flower's ``SecAggPlusWorkflow.setup_stage`` does (of the
        round's ``num_shares``, at least 2), then is raised to :data:`SECAGG_MIN_PARTIES`:
        Flower's floor of 2 would let a round of 3 be unmasked with 2 survivors.
        """
        count = self.threshold_count
        if count is None:
            shares = round(self.num_shares * selected)
            if shares < selected and shares % 2 == 0:
                shares += 1
            if shares <= 2:
                shares = selected
            count = max(round(self.reconstruction_threshold * shares), 2)
        return max(count, SECAGG_MIN_PARTIES)

    def check_round(self, selected: int) -> None:
        """A round of ``selected`` parties can be unmasked at all (else PrivacyError)."""
        if selected < SECAGG_MIN_PARTIES:
            raise PrivacyError(
                f"SecAgg+ needs at least {SECAGG_MIN_PARTIES} parties per round (with two, "
                f"each learns the other's update from their sum), got {selected}"
            )
        count = self.threshold_count
        if count is not None and count > selected:
            raise PrivacyError(
                f"SecAgg+'s threshold ({count}) is more than the {selected} parties this "
                "round asks: no round could be unmasked; lower privacy.secagg_threshold or "
                "ask more parties per round (fewer tiers)"
            )


def quantization_error_bound(
    weights: Sequence[float],
    max_abs_value: float,
    *,
    clipping_range: float,
    quantization_range: int,
    max_weight: float = DEFAULT_MAX_WEIGHT,
) -> float:
    """The largest |SecAgg+ mean - plain weighted mean| per value, for these parties.

    Following Flower's ``secaggplus_mod``: party ``i`` scales its update by
    ``d_i = round(n_i / W * T) / T`` (T = quantization_range, W = max_weight), shifts it
    by the clipping range c and rounds it stochastically to a step of ``2c / T`` (under
    one step, plus float32 rounding of the scaled value: two steps are allowed). The
    server divides the unmasked sum by ``sum(d_i)``. So the error is at most
    ``(k * 2 * 2c/T + max|p| * k / T) / sum(d_i)`` (rounding, then the weights' own
    rounding of at most ``1/(2T)`` each), plus float32's rounding of the result.
    Raises ValueError when an update would be clipped (``max|p| * max d_i > c``): then
    no such bound holds.
    """
    if not weights:
        raise ValueError("no parties: no bound")
    T, c = float(quantization_range), float(clipping_range)
    scaled = [round(w / max_weight * T) / T for w in weights]
    if max_abs_value * max(scaled) > c:
        raise ValueError(
            f"updates up to {max_abs_value} weighted by up to {max(scaled):.4g} exceed the "
            f"clipping range {c}: SecAgg+ clips them (raise clipping range or max_weight)"
        )
    total = sum(scaled)
    if total <= 0:
        raise ValueError("every party's weight rounds to 0 (raise the quantization range)")
    k = len(weights)
    rounding = k * 2 * (2 * c / T)
    weighting = max_abs_value * k / T
    return (rounding + weighting) / total + max_abs_value * 2.0**-23


def run_secagg(
    grid: Grid,
    strategy: StreamingFedAvg,
    initial_arrays: ArrayRecord,
    settings: SecAggSettings,
    *,
    num_rounds: int,
    train_config: ConfigRecord | None = None,
    timeout: float = 600.0,
    first_round: int = 1,
    evaluate_fn: EvaluateFn | None = None,
    checkpoint_fn: CheckpointFn | None = None,
    recorder: Callable[[Grid], Grid] | None = None,
) -> Result:
    """Rounds ``first_round..num_rounds`` of SecAgg+, planned and recorded by ``strategy``.

    ``grid`` is what the strategy plans over (an :class:`IdentifiedGrid` shows it stable
    party ids; the protocol then runs on the grid behind it with the runtime's own node
    ids, the ids the parties' ``secaggplus_mod`` knows itself by). ``timeout`` bounds the
    masked-vector stage when no deadline applies. ``recorder`` may wrap the grid the
    protocol talks to (tests record what the server received). Checked before round 1:
    the strategy's ``per_round`` and the grid's parties can meet the threshold. TiFL's
    tiers are formed with at least :data:`SECAGG_MIN_PARTIES` parties each (fewer tiers
    than asked when the fleet is small).
    """
    if num_rounds < first_round:
        return Result(arrays=initial_arrays)
    if not fold_groups_are_plain(strategy):
        raise PrivacyError(
            f"{type(strategy).__name__} folds replies into several models; SecAgg+ "
            "yields one aggregate per round"
        )
    if strategy.deadline.late_policy == "stale":
        raise PrivacyError(
            "SecAgg+ cannot fold a late reply into a later round (late_policy = 'stale'): "
            "a masked vector's masks cancel only in its own round's sum, so a party past "
            "the deadline is a dropout; remove late_policy"
        )
    settings.check_round(strategy.per_round)
    parties = len(list(grid.get_node_ids()))
    if parties < SECAGG_MIN_PARTIES:
        raise PrivacyError(
            f"SecAgg+ needs at least {SECAGG_MIN_PARTIES} connected parties, the grid shows "
            f"{parties}: wait for the nodes to connect before the first round"
        )
    if isinstance(strategy, TieredFedAvg):
        strategy.min_tier_size = max(strategy.min_tier_size, SECAGG_MIN_PARTIES)
    settings.check_round(min(parties, strategy.per_round))
    nodes = _node_map(grid)
    # Every stage waits on our own clock (PolledGrid), so a party that dies silently
    # costs the stage's timeout, never Flower's heartbeat expiry or its 3 s pull sleep.
    polled = PolledGrid(nodes.wire, strategy.pull_interval_s)
    wire = recorder(polled) if recorder is not None else polled
    config = train_config or ConfigRecord()

    def play(server_round: int, arrays: ArrayRecord) -> RoundOutcome | None:
        if server_round == first_round:
            _check_range(arrays, settings)  # the starting model: refused, not clipped
        if not strategy.can_train(server_round, grid):
            return None
        _check_range(arrays, settings, warn_only=True)
        stages = StageRecorder(wire)
        round_ = SecAggRound(
            strategy, grid, nodes, stages, settings, arrays, config, timeout=timeout
        )
        return RoundOutcome.of(*round_.run(server_round, _context(grid)))

    return run_rounds(
        play,
        initial_arrays,
        num_rounds=num_rounds,
        first_round=first_round,
        observers=strategy.observers,
        evaluate_fn=evaluate_fn,
        checkpoint_fn=checkpoint_fn,
    )


def _check_range(arrays: ArrayRecord, settings: SecAggSettings, *, warn_only: bool = False) -> None:
    """SecAgg+ clips every value a party sends to [-clipping_range, clipping_range], and
    sends whole models: a model already at the range would be clipped without a word."""
    peak = max((float(np.max(np.abs(a.numpy()))) for a in arrays.values() if a.numpy().size),
               default=0.0)  # fmt: skip
    if peak < settings.clipping_range:
        return
    message = (
        f"the model holds a value of {peak:.4g}, at or beyond SecAgg+'s clipping range "
        f"({settings.clipping_range:g}): raise privacy.secagg_clipping_range"
    )
    if not warn_only:
        raise PrivacyError(message)
    log(WARNING, "%s (values beyond it are clipped)", message)


def fold_groups_are_plain(strategy: StreamingFedAvg) -> bool:
    """Whether the strategy folds every reply into one mean (FedAvg, FedProx, TiFL)."""
    from fedge.aggregator.strategies.hooks import RoundHooks

    return type(strategy).fold_group is RoundHooks.fold_group


def _node_map(grid: Grid) -> NodeMap:
    if isinstance(grid, IdentifiedGrid):
        return NodeMap(grid.inner, to_wire=grid.real_node_id, from_wire=grid.shown_node_id)
    return NodeMap(grid, to_wire=_same, from_wire=_same)


def _same(node: int) -> int:
    return node


def _context(grid: Grid) -> Context:
    """A fresh server context for one round of the workflow (its state is the round's)."""
    return Context(
        run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={}
    )

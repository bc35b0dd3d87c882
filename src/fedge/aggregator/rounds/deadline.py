"""Round planning with over-selection, a k-of-n quorum and a deadline, usable with any selection.

Three straggler remedies, all pure:

* **Over-selection** (Oort's over-commitment, Lai et al., OSDI'21: ask 1.3x and keep the
  first K): :func:`plan_round` asks ``ceil(per_round * (1 + over_selection))`` parties.
* **Quorum and deadline** (FedCS, Nishio & Yonetani, ICC'19; Google-style deadlines): the
  round ends at its k-th reply or at its deadline, whichever comes first (:func:`settle`).
  Replies after the end are *late*: dropped, or folded into a later round discounted by
  :func:`staleness_weight` (FedBuff, Nguyen et al., AISTATS'22).
* Times are seconds from the round's start -- wall or virtual, the functions do not care.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


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


@dataclass(frozen=True)
class RoundPlan:
    """Who is asked, how many replies end the round early, and when it ends at the latest."""

    selected: tuple[int, ...]
    quorum: int  # k: the round may end once k replies are in
    deadline_s: float | None  # None: wait for the quorum (or for everyone who replies)

    def __post_init__(self) -> None:
        if not self.selected:
            raise ValueError("a round plan needs at least one selected party")
        if len(set(self.selected)) != len(self.selected):
            raise ValueError(f"selected parties repeat: {self.selected}")
        if not 1 <= self.quorum <= len(self.selected):
            raise ValueError(f"quorum must be in [1, {len(self.selected)}], got {self.quorum}")
        if self.deadline_s is not None and not (
            math.isfinite(self.deadline_s) and self.deadline_s >= 0
        ):
            raise ValueError(f"deadline_s must be >= 0 seconds, got {self.deadline_s}")


def plan_round(
    candidates: Sequence[int],
    per_round: int,
    *,
    over_selection: float,
    quorum_fraction: float,
    expected_latency_s: float | None,
    deadline_factor: float,
    rng: np.random.Generator,
) -> RoundPlan:
    """Sample this round's parties uniformly from ``candidates`` (e.g. one TiFL tier).

    * selected: ``ceil(per_round * (1 + over_selection))``, capped by the candidates;
    * quorum: ``ceil(per_round * quorum_fraction)``, at least 1 and at most the selected;
    * deadline: ``expected_latency_s * deadline_factor``, None without an estimate.

    ``selected`` keeps the sampled order.
    """
    if not candidates:
        raise ValueError("no candidates to select from")
    if len(set(candidates)) != len(candidates):
        raise ValueError("candidates repeat a party")
    if per_round < 1:
        raise ValueError(f"per_round must be >= 1, got {per_round}")
    if not (math.isfinite(over_selection) and over_selection >= 0):
        raise ValueError(f"over_selection must be >= 0, got {over_selection}")
    if not 0 < quorum_fraction <= 1:
        raise ValueError(f"quorum_fraction must be in (0, 1], got {quorum_fraction}")
    if not (math.isfinite(deadline_factor) and deadline_factor > 0):
        raise ValueError(f"deadline_factor must be > 0, got {deadline_factor}")
    if expected_latency_s is not None and not (
        math.isfinite(expected_latency_s) and expected_latency_s >= 0
    ):
        raise ValueError(f"expected_latency_s must be >= 0 seconds, got {expected_latency_s}")
    count = min(len(candidates), _ceil(per_round * (1 + over_selection)))
    picked = rng.choice(len(candidates), size=count, replace=False)
    selected = tuple(int(candidates[int(i)]) for i in picked)
    quorum = min(max(1, _ceil(per_round * quorum_fraction)), count)
    deadline = None if expected_latency_s is None else expected_latency_s * deadline_factor
    return RoundPlan(selected, quorum, deadline)


@dataclass(frozen=True)
class Settlement:
    """How a round ended: who made it, who was late, who never answered, and when."""

    on_time: tuple[int, ...]  # in arrival order
    late: tuple[int, ...]  # in arrival order
    failed: tuple[int, ...]  # in selection order
    round_time_s: float
    quorum_met: bool


def settle(plan: RoundPlan, arrivals: Mapping[int, float | None]) -> Settlement:
    """Decide a round from each selected party's reply time (None: failed or never).

    The round ends at the k-th reply if that comes by the deadline; otherwise at the
    deadline, with whatever arrived (``quorum_met=False``). Without a deadline it ends at
    the k-th reply, or at the last reply when fewer than k come (0.0 when none do).
    Replies at the end instant count as on time, so ties at the k-th reply all count and
    ``on_time`` may hold more than k. Selected parties missing from ``arrivals`` failed.

    A None is read pessimistically: the party might still answer, so a round short of its
    quorum waits until the deadline even if everyone else has answered or failed.
    """
    unknown = sorted(set(arrivals) - set(plan.selected))
    if unknown:
        raise ValueError(f"arrivals for parties that were not selected: {unknown}")
    position = {party: index for index, party in enumerate(plan.selected)}
    replied: list[tuple[float, int]] = []
    for party in plan.selected:
        at = arrivals.get(party)
        if at is None:
            continue
        if not (math.isfinite(at) and at >= 0):
            raise ValueError(f"arrival time of party {party} must be >= 0 seconds, got {at}")
        replied.append((at, party))
    replied.sort(key=lambda item: (item[0], position[item[1]]))
    k, deadline = plan.quorum, plan.deadline_s
    in_time = replied if deadline is None else [r for r in replied if r[0] <= deadline]
    if len(in_time) >= k:
        end = in_time[k - 1][0]
    elif deadline is not None:
        end = deadline
    else:
        end = replied[-1][0] if replied else 0.0
    return Settlement(
        on_time=tuple(party for at, party in replied if at <= end),
        late=tuple(party for at, party in replied if at > end),
        failed=tuple(party for party in plan.selected if arrivals.get(party) is None),
        round_time_s=end,
        quorum_met=sum(1 for at, _ in replied if at <= end) >= k,
    )


def staleness_weight(staleness_rounds: int, *, exponent: float = 0.5) -> float:
    """FedBuff's polynomial staleness discount ``1 / (1 + s)^exponent`` (FLSim's
    ``PolynomialStalenessWeight``; exponent 0.5 is the paper's ``1/sqrt(1 + tau)``).

    ``s`` is the number of server updates since the party downloaded the model it trained
    on; multiply the reply's example weight by this factor before folding it.
    """
    if staleness_rounds < 0:
        raise ValueError(f"staleness_rounds must be >= 0, got {staleness_rounds}")
    if not (math.isfinite(exponent) and exponent >= 0):
        raise ValueError(f"exponent must be >= 0, got {exponent}")
    return float(1 / (1 + staleness_rounds) ** exponent)


def _ceil(value: float) -> int:
    # 10 * 1.1 is 11.000000000000002 in binary floating point; it means 11, not 12.
    return math.ceil(value - 1e-9 * max(1.0, abs(value)))

"""A staged rollout's plan: which edges, canary first, in which waves, watched how long,
stopped on what. Pure parsing and validation into frozen dataclasses.

Staged rollouts with abort criteria follow AWS IoT Jobs (``abortConfig``: a failure type,
a threshold, a minimum number of executions) and Greengrass deployments: a change reaches
a canary first, then growing shares of the fleet, each wave observed for a health window
before the next, and any wave can stop the rollout (issue "The closed loop").

Two deadlines bound the waiting (AWS IoT Jobs' ``timeoutConfig``): an edge that has not
settled (reported the new model active, or failed) within ``activation_timeout_s`` of its
move counts as a failed activation, and an edge sent back that has not confirmed its
previous model within ``rollback_timeout_s`` of the abort is given up on (marked
unconfirmed) so that the rollout ends. Plans stored before these fields existed decode
with the defaults.

A wave also waits for the stations' own verdicts (``wait_for_probation``, the default):
the agent keeps a newly activated model on probation (its first images or minutes) and
reports ``passed`` or rolls it back itself. A wave completes only once every moved edge
has said ``passed``; an edge whose verdict has not come ``probation_timeout_s`` after it
settled counts as a failure (``probation_timeout``), so a silent station cannot hold a
rollout forever. Without the wait, a wave shorter than the agents' probation can
complete before a station rolls back, and the fleet then serves two versions (the
driver marks such a rollout ``degraded``; see rollouts.py).

A plan may carry an anomaly model (``anomaly``, ``NAME:VERSION``; issue 28) served beside
the classifier: every moved edge gets the pair in one deployment, the stations verify,
swap, judge and roll back the pair together, and a rollback restores each edge's
previous pair. A rollout whose classifier an edge serves already changes only its
anomaly model there -- still a new deployment, with its probation and health window.
A plan without one changes only the classifier: an edge serving an anomaly model keeps
it beside the new classifier, with its threshold, where it takes the same images
(rollout/writes.py). Plans stored before the field existed decode with none.

``failed_activation`` is also an implicit criterion: an edge that failed to activate the
model, rolled it back on its own, or did not settle in time aborts the rollout whatever
``--abort-if`` says, and never counts as moved or healthy. Criteria that hold for every
value a metric can take (``alerts>=0``) are refused: they would abort every rollout.

Every problem raises :class:`RolloutError` naming the bad part of the input.
"""

import difflib
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from fedge.edge_manager.errors import ManagerError


class RolloutError(ManagerError):
    """A rollout cannot be planned, started or changed; nothing was changed."""


class Metric(StrEnum):
    """What an abort criterion watches on each moved edge, since it moved (rollout_health)."""

    AGREEMENT_DROP = "agreement_drop"  # label agreement, previous model minus new model
    FAILED_ACTIVATION = "failed_activation"  # 1 if the new model failed or was rolled back
    ERROR_RATE = "error_rate"  # inference errors / (errors + scored images)
    LATENCY_P95_MS = "latency_p95_ms"  # of the new model's predictions
    ALERTS = "alerts"  # open alerts raised on the edge since it moved
    EST_ACCURACY_DROP = "est_accuracy_drop"  # MPP estimate, previous model minus new model
    # Novel parts (not recognised as a known defect, over the anomaly threshold) over
    # parts with a verdict,
    # of the new model's predictions (issue 28)
    NOVEL_RATE = "novel_rate"


# Metrics that are never below 0, so ``METRIC>=0`` always holds (the drops can be < 0).
NON_NEGATIVE = frozenset(
    {
        Metric.FAILED_ACTIVATION,
        Metric.ERROR_RATE,
        Metric.LATENCY_P95_MS,
        Metric.ALERTS,
        Metric.NOVEL_RATE,
    }
)
DEFAULT_ACTIVATION_TIMEOUT_S = 600.0
DEFAULT_ROLLBACK_TIMEOUT_S = 600.0
# Longer than the agent's default probation (probation_s = 600 in agent.toml): a verdict
# not in by then is a station that cannot give one, not a slow one.
DEFAULT_PROBATION_TIMEOUT_S = 900.0


class Op(StrEnum):
    GT = ">"
    GE = ">="


@dataclass(frozen=True)
class Criterion:
    """Abort when ``metric`` ``op`` ``value`` holds on any moved edge."""

    metric: Metric
    op: Op
    value: float

    def tripped(self, observed: float) -> bool:
        return observed > self.value if self.op is Op.GT else observed >= self.value

    def __str__(self) -> str:
        return f"{self.metric.value}{self.op.value}{self.value:g}"


@dataclass(frozen=True)
class RolloutPlan:
    """``edges``: every target edge, canary included, sorted; ``waves``: cumulative
    fractions of the non-canary edges, increasing, the last 1.0. ``activation_timeout_s``:
    how long a moved edge may take to settle; ``rollback_timeout_s``: how long an edge sent
    back may take to confirm its previous model (both from the manager's clock).
    ``wait_for_probation``: a wave completes only once each of its edges reported its
    probation ``passed``; ``probation_timeout_s``: how long after settling that may take."""

    edges: tuple[str, ...]
    canary: tuple[str, ...]
    waves: tuple[float, ...]
    health_window_s: float
    abort_if: tuple[Criterion, ...]
    activation_timeout_s: float = DEFAULT_ACTIVATION_TIMEOUT_S
    rollback_timeout_s: float = DEFAULT_ROLLBACK_TIMEOUT_S
    wait_for_probation: bool = True
    probation_timeout_s: float = DEFAULT_PROBATION_TIMEOUT_S
    # The anomaly model served beside the classifier (``NAME:VERSION``; None: none).
    anomaly: str | None = None

    def __post_init__(self) -> None:
        if self.anomaly is not None:
            anomaly_ref(self.anomaly)
        if not self.edges:
            raise RolloutError("a rollout needs at least one target edge")
        if len(set(self.edges)) != len(self.edges):
            raise RolloutError(f"edges named twice: {', '.join(_twice(self.edges))}")
        outside = sorted(set(self.canary) - set(self.edges))
        if outside:
            raise RolloutError(
                f"canary edge(s) {', '.join(outside)} are not among the rollout's target edges"
            )
        _check_waves(self.waves, ", ".join(f"{w * 100:g}%" for w in self.waves))
        if not math.isfinite(self.health_window_s) or self.health_window_s <= 0:
            raise RolloutError(f"the health window must be > 0 s, got {self.health_window_s}")
        for what, seconds in (
            ("activation timeout", self.activation_timeout_s),
            ("rollback timeout", self.rollback_timeout_s),
            ("probation timeout", self.probation_timeout_s),
        ):
            if not math.isfinite(seconds) or seconds <= 0:
                raise RolloutError(f"the {what} must be > 0 s, got {seconds}")

    def assignment(self) -> tuple[tuple[str, int], ...]:
        """(edge, wave) for every target edge: the canary is wave 0, then wave k holds
        the non-canary edges up to ``ceil(waves[k-1] * n)`` in name order (cumulative, so
        ``25%,50%,100%`` of 8 edges moves 2, then 2 more, then the last 4). A wave can be
        empty when the fleet is small; it is skipped."""
        rest = sorted(set(self.edges) - set(self.canary))
        pairs = [(edge, 0) for edge in sorted(self.canary)]
        done = 0
        for number, share in enumerate(self.waves, start=1):
            upto = min(len(rest), math.ceil(share * len(rest) - 1e-9))
            pairs += [(edge, number) for edge in rest[done:upto]]
            done = max(done, upto)
        return tuple(pairs)

    def to_json_dict(self) -> dict[str, object]:
        return {
            "edges": list(self.edges),
            "canary": list(self.canary),
            "waves": list(self.waves),
            "health_window_s": self.health_window_s,
            "abort_if": [str(c) for c in self.abort_if],
            "activation_timeout_s": self.activation_timeout_s,
            "rollback_timeout_s": self.rollback_timeout_s,
            "wait_for_probation": self.wait_for_probation,
            "probation_timeout_s": self.probation_timeout_s,
            **({} if self.anomaly is None else {"anomaly": self.anomaly}),
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, object]) -> "RolloutPlan":
        """The plan as :meth:`to_json_dict` stored it (the timeouts default when absent:
        plans stored before they existed)."""
        damaged = RolloutError(f"a stored rollout plan is damaged: {data!r}")
        edges, canary = data.get("edges"), data.get("canary")
        waves, abort_if = data.get("waves"), data.get("abort_if")
        if not (
            isinstance(edges, list)
            and isinstance(canary, list)
            and isinstance(waves, list)
            and isinstance(abort_if, list)
        ):
            raise damaged
        numbers: dict[str, float] = {}
        for key, default in (
            ("health_window_s", None),
            ("activation_timeout_s", DEFAULT_ACTIVATION_TIMEOUT_S),
            ("rollback_timeout_s", DEFAULT_ROLLBACK_TIMEOUT_S),
            ("probation_timeout_s", DEFAULT_PROBATION_TIMEOUT_S),
        ):
            value = data.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise damaged
            numbers[key] = float(value)
        if not all(isinstance(w, int | float) and not isinstance(w, bool) for w in waves):
            raise damaged
        wait = data.get("wait_for_probation", True)
        if not isinstance(wait, bool):
            raise damaged
        anomaly = data.get("anomaly")
        if anomaly is not None and not isinstance(anomaly, str):
            raise damaged
        return cls(
            edges=tuple(str(e) for e in edges),
            canary=tuple(str(e) for e in canary),
            waves=tuple(float(w) for w in waves),
            health_window_s=numbers["health_window_s"],
            abort_if=parse_criteria(",".join(str(c) for c in abort_if)),
            activation_timeout_s=numbers["activation_timeout_s"],
            rollback_timeout_s=numbers["rollback_timeout_s"],
            wait_for_probation=wait,
            probation_timeout_s=numbers["probation_timeout_s"],
            anomaly=anomaly,
        )


_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}:[0-9]{1,9}$")


def anomaly_ref(text: str) -> tuple[str, int]:
    """``"inspect-anomaly:2"`` -> ``("inspect-anomaly", 2)``, or RolloutError."""
    if _REF.match(text.strip()) is None:
        raise RolloutError(
            f"anomaly model {text!r} must look like NAME:VERSION, e.g. inspect-anomaly:1; "
            "nothing was started"
        )
    name, _, version = text.strip().rpartition(":")
    return name, int(version)


def make_plan(
    edges: Sequence[str],
    *,
    canary: Sequence[str] = (),
    waves: str = "100%",
    health_window: str = "10m",
    abort_if: str = "failed_activation>0",
    activation_timeout: str = "10m",
    rollback_timeout: str = "10m",
    wait_for_probation: bool = True,
    probation_timeout: str = "15m",
    anomaly: str | None = None,
) -> RolloutPlan:
    """A plan from what an operator typed (``--waves 25%,50%,100% --health-window 10m``)."""
    if _twice(canary):
        raise RolloutError(f"canary edges named twice: {', '.join(_twice(canary))}")
    if _twice(edges):
        raise RolloutError(f"edges named twice: {', '.join(_twice(edges))}")
    return RolloutPlan(
        edges=tuple(sorted(edges)),
        canary=tuple(sorted(canary)),
        waves=parse_waves(waves),
        health_window_s=parse_duration(health_window),
        abort_if=parse_criteria(abort_if),
        activation_timeout_s=parse_duration(activation_timeout, "activation timeout"),
        rollback_timeout_s=parse_duration(rollback_timeout, "rollback timeout"),
        wait_for_probation=wait_for_probation,
        probation_timeout_s=parse_duration(probation_timeout, "probation timeout"),
        anomaly=None if anomaly is None else anomaly.strip(),
    )


_PERCENT = re.compile(r"^(\d+(?:\.\d+)?)\s*%?$")


def parse_waves(text: str) -> tuple[float, ...]:
    """``"25%,50%,100%"`` -> ``(0.25, 0.5, 1.0)``: cumulative shares, increasing, to 100%."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip():
        raise RolloutError("--waves is empty; give cumulative percentages, e.g. 25%,50%,100%")
    shares = []
    for part in parts:
        match = _PERCENT.match(part)
        if match is None:
            raise RolloutError(
                f"wave {part!r} in {text!r} is not a percentage; write e.g. 25%,50%,100%"
            )
        percent = float(match.group(1))
        if not 0 < percent <= 100:
            raise RolloutError(f"wave {part!r} in {text!r} must be in (0%, 100%]")
        shares.append(percent / 100.0)
    _check_waves(tuple(shares), text)
    return tuple(shares)


def _check_waves(shares: tuple[float, ...], text: str) -> None:
    if not shares:
        raise RolloutError("a rollout needs at least one wave (e.g. --waves 100%)")
    for before, after in itertools.pairwise(shares):
        if after <= before:
            raise RolloutError(
                f"waves {text!r} must increase (they are cumulative): "
                f"{after * 100:g}% comes after {before * 100:g}%"
            )
    if shares[0] <= 0 or any(share > 1.0 for share in shares):
        raise RolloutError(f"waves {text!r} must be between 0% and 100%")
    if shares[-1] != 1.0:
        raise RolloutError(f"waves {text!r} must end at 100% so that every edge is reached")


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|m|h)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, what: str = "health window") -> float:
    """``"10m"`` -> 600.0 seconds (units: ms, s, m, h); ``what`` names it in errors."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise RolloutError(
            f"{what} {text!r} is not a duration; write a number and a unit "
            "(ms, s, m or h), e.g. 30s, 10m, 2h"
        )
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds <= 0:
        raise RolloutError(f"{what} {text!r} must be longer than 0")
    if seconds > 7 * 86400:
        raise RolloutError(f"{what} {text!r} is longer than a week; use at most 168h")
    return seconds


_CRITERION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(>=|>|<=|<|==|=)\s*(.*)$")


def parse_criteria(text: str) -> tuple[Criterion, ...]:
    """``"agreement_drop>0.02,failed_activation>0"`` -> criteria (``>`` or ``>=`` only)."""
    if not text.strip():
        raise RolloutError(
            "--abort-if is empty; give at least one criterion, e.g. failed_activation>0"
        )
    criteria: list[Criterion] = []
    for raw in text.split(","):
        part = raw.strip()
        match = _CRITERION.match(part)
        if match is None:
            raise RolloutError(
                f"abort criterion {part!r} in {text!r} must look like METRIC>NUMBER, "
                f"e.g. error_rate>0.01; metrics: {_known()}"
            )
        name, op, number = match.groups()
        if name not in {m.value for m in Metric}:
            close = difflib.get_close_matches(name, [m.value for m in Metric], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RolloutError(
                f"abort criterion {part!r}: unknown metric {name!r}{hint}; metrics: {_known()}"
            )
        if op not in (">", ">="):
            raise RolloutError(
                f"abort criterion {part!r}: comparison {op!r} is not supported; an abort "
                "criterion says when a metric is too high: use > or >="
            )
        try:
            value = float(number.strip())
        except ValueError:
            raise RolloutError(
                f"abort criterion {part!r}: {number.strip()!r} is not a number"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise RolloutError(f"abort criterion {part!r}: the limit must be a finite number >= 0")
        metric = Metric(name)
        if op == ">=" and value == 0 and metric in NON_NEGATIVE:
            raise RolloutError(
                f"abort criterion {part!r} always holds ({name} is never below 0), so it "
                f"would abort every rollout; write {name}>0 to abort on any"
            )
        if any(c.metric is metric for c in criteria):
            raise RolloutError(f"abort criteria {text!r} name {name} twice; give it once")
        criteria.append(Criterion(metric, Op(op), value))
    return tuple(criteria)


def _known() -> str:
    return ", ".join(m.value for m in Metric)


def _twice(names: Sequence[str]) -> list[str]:
    return sorted({n for n in names if list(names).count(n) > 1})

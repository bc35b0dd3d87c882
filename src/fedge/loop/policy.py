"""When the fleet trains again: a continuous-training policy per model, and its trigger.

Continuous training in the sense of TFX/Kubeflow pipelines ("Towards ML Engineering: A
Brief History Of TensorFlow Extended", Karmarkar et al. 2020): a new model is trained
when new data or a monitoring signal says the serving one may be stale, and nothing it
produces serves before a validation gate blesses it and a staged rollout proves it. Here
the new data is operator labels arriving at the manager, and the signals are the
monitor's alerts (input or score drift, a label-free accuracy estimate under its floor).

Pure: the runner (:mod:`fedge.loop.runner`) observes the store and asks :func:`decide`.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field

from fedge.loop.errors import LoopError

# Alert kinds the monitor raises (edge_manager/monitor/tick.py); "drift" names both drifts.
ALERT_KINDS = frozenset({"input_drift", "score_drift", "accuracy_estimate"})
ALERT_GROUPS = {"drift": frozenset({"input_drift", "score_drift"})}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class LoopPolicyError(LoopError):
    """A continuous-training policy that cannot be used (the message says which part)."""


@dataclass(frozen=True)
class LoopPolicy:
    """``fedge loop enable MODEL --min-new-labels N --or-on-alert drift ...``.

    ``job`` is the fleet job manifest (TOML text) the loop runs; its ``task.model`` is
    replaced by the model serving when the loop triggers. The rollout fields are the
    ones of ``fedge rollout start`` and are checked by the rollout plan parser when the
    policy is enabled. ``cooldown_s`` is the least time between two loop runs, so a
    lasting alert does not start a job after every other.
    """

    model: str
    job: str
    min_new_labels: int = 200
    on_alerts: frozenset[str] = field(default_factory=frozenset)
    canary: tuple[str, ...] = ()
    waves: str = "25%,50%,100%"
    health_window: str = "10m"
    abort_if: str = "failed_activation>0,error_rate>0.01"
    cooldown_s: float = 3600.0
    enabled: bool = True

    def __post_init__(self) -> None:
        if not _NAME.match(self.model):
            raise LoopPolicyError(f"model name {self.model!r} is not a registry model name")
        if self.min_new_labels < 0:
            raise LoopPolicyError(f"--min-new-labels must be >= 0, got {self.min_new_labels}")
        if self.min_new_labels == 0 and not self.on_alerts:
            raise LoopPolicyError(
                "the policy would never trigger: give --min-new-labels N (N > 0) and/or "
                "--or-on-alert KIND"
            )
        unknown = set(self.on_alerts) - ALERT_KINDS
        if unknown:
            raise LoopPolicyError(
                f"unknown alert kind(s) {sorted(unknown)}; use {sorted(ALERT_KINDS)} or 'drift'"
            )
        if not 0 <= self.cooldown_s <= 30 * 86400:
            raise LoopPolicyError(f"--cooldown must be in [0, 30 days], got {self.cooldown_s}s")
        if not self.job.strip():
            raise LoopPolicyError("the policy needs a fleet job manifest (--job job.toml)")


def alert_kinds(names: list[str]) -> frozenset[str]:
    """``["drift", "accuracy_estimate"]`` -> the alert kinds they name."""
    kinds: set[str] = set()
    for name in names:
        for part in (p.strip() for p in name.split(",")):
            if not part:
                continue
            if part in ALERT_GROUPS:
                kinds |= ALERT_GROUPS[part]
            elif part in ALERT_KINDS:
                kinds.add(part)
            else:
                raise LoopPolicyError(
                    f"unknown alert kind {part!r}; use drift, {', '.join(sorted(ALERT_KINDS))}"
                )
    return frozenset(kinds)


@dataclass(frozen=True)
class Observation:
    """What the runner read from the store for one policy."""

    new_labels: int  # operator labels received since the last loop run started
    open_alerts: tuple[tuple[str, str], ...]  # (edge, kind) of open alerts raised since then
    running: bool  # a loop run of this model has not ended
    last_started_at: float | None


@dataclass(frozen=True)
class Decision:
    start: bool
    reason: str


def decide(policy: LoopPolicy, seen: Observation, now: float) -> Decision:
    """Whether a new loop run starts now, and why (or why not): pure."""
    if not policy.enabled:
        return Decision(False, "the policy is disabled")
    if seen.running:
        return Decision(False, "a loop run of this model is still going")
    if seen.last_started_at is not None and now - seen.last_started_at < policy.cooldown_s:
        left = policy.cooldown_s - (now - seen.last_started_at)
        return Decision(False, f"cooling down ({left:.0f}s left)")
    alerts = sorted(
        {f"{kind} at {edge}" for edge, kind in seen.open_alerts if kind in policy.on_alerts}
    )
    if alerts:
        return Decision(True, "alert: " + ", ".join(alerts))
    if policy.min_new_labels and seen.new_labels >= policy.min_new_labels:
        return Decision(
            True, f"{seen.new_labels} new labels (policy: at least {policy.min_new_labels})"
        )
    return Decision(
        False,
        f"{seen.new_labels}/{policy.min_new_labels} new labels, no triggering alert"
        if policy.min_new_labels
        else "no triggering alert",
    )


def job_for(template: str, start_model: str) -> str:
    """The policy's fleet job manifest with ``[task] model`` set to ``start_model``.

    The text is edited, not re-serialised, so the operator's comments and layout stay;
    the result is parsed again by the fleet job's own loader before anything runs.
    """
    try:
        document = tomllib.loads(template)
    except tomllib.TOMLDecodeError as exc:
        raise LoopPolicyError(f"the policy's job manifest is not TOML: {exc}") from None
    task = document.get("task")
    if not isinstance(task, dict) or "model" not in task:
        raise LoopPolicyError("the policy's job manifest needs a [task] table with model = ...")
    lines = template.splitlines()
    section = ""
    for index, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.strip("[] ")
        elif section == "task" and re.match(r"model\s*=", stripped):
            lines[index] = f'model = "{start_model}"'
            return "\n".join(lines) + "\n"
    raise LoopPolicyError("the policy's job manifest sets task.model in a form fedge cannot edit")

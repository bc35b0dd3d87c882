"""Pure decisions on the edge: whether to apply a config, and what a score means."""

from dataclasses import dataclass
from enum import StrEnum

from fedge.protocols.config import EdgeConfig


class ConfigAction(StrEnum):
    APPLY = "apply"
    IGNORE = "ignore"  # stale: at or below the version in force (a redelivered retained copy)
    REJECT = "reject"


@dataclass(frozen=True)
class ConfigDecision:
    action: ConfigAction
    reason: str = ""


def decide_config(
    applied: EdgeConfig | None, offered: EdgeConfig, fleet: str, edge: str
) -> ConfigDecision:
    if offered.fleet != fleet or offered.edge != edge:
        return ConfigDecision(
            ConfigAction.REJECT,
            f"document is for {offered.fleet}/{offered.edge}, this is {fleet}/{edge}",
        )
    if applied is not None and offered.version <= applied.version:
        return ConfigDecision(
            ConfigAction.IGNORE, f"version {offered.version} <= applied {applied.version}"
        )
    return ConfigDecision(ConfigAction.APPLY)


@dataclass(frozen=True)
class Decision:
    decision: str  # "accept" | "reject"
    threshold: float  # the threshold that decided
    deciding_class: str


def decide(
    scores: dict[str, float],
    positive_classes: tuple[str, ...],
    config: EdgeConfig | None,
    default_threshold: float = 0.5,
) -> Decision:
    """Reject when any defect class scores at or above its threshold.

    Without declared positive classes every class but the first (conventionally "ok") is a
    defect. The recorded threshold is that of the deciding class: the highest-scoring
    defect class when accepting, the first one over its threshold when rejecting.
    """
    classes = list(scores)
    positives = [c for c in (positive_classes or tuple(classes[1:])) if c in scores]
    if not positives:
        threshold = default_threshold if config is None else config.default_threshold
        return Decision("accept", threshold, "")
    best = None
    for name in sorted(positives, key=lambda c: -scores[c]):
        threshold = default_threshold if config is None else config.threshold_for(name)
        if scores[name] >= threshold:
            return Decision("reject", threshold, name)
        if best is None:
            best = Decision("accept", threshold, name)
    assert best is not None
    return best

"""Pure decisions on the edge: whether to apply a config, which thresholds are in force,
and what a score means."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import ModelManifest


class ConfigAction(StrEnum):
    APPLY = "apply"
    IGNORE = "ignore"  # stale: at or below the version in force (a redelivered retained copy)
    REJECT = "reject"


@dataclass(frozen=True)
class ConfigDecision:
    action: ConfigAction
    reason: str = ""


def decide_config(
    applied: EdgeConfig | None,
    offered: EdgeConfig,
    fleet: str,
    edge: str,
    done_version: int = 0,
) -> ConfigDecision:
    """Apply, ignore or reject an offered config.

    ``done_version`` is the newest version the edge is done with without applying it: a
    local rollback put the previous model's config back in place of it (issue "The
    closed loop"), so that version, retained on the broker, must not come back.
    """
    if offered.fleet != fleet or offered.edge != edge:
        return ConfigDecision(
            ConfigAction.REJECT,
            f"document is for {offered.fleet}/{offered.edge}, this is {fleet}/{edge}",
        )
    if applied is not None and offered.version <= applied.version:
        return ConfigDecision(
            ConfigAction.IGNORE, f"version {offered.version} <= applied {applied.version}"
        )
    if offered.version <= done_version:
        return ConfigDecision(
            ConfigAction.IGNORE, f"version {offered.version} <= {done_version}, rolled back"
        )
    return ConfigDecision(ConfigAction.APPLY)


class ThresholdSource(StrEnum):
    CONFIG = "config"  # the operator's config, set for the serving model (or for any model)
    MODEL = "model"  # the serving model's recommended thresholds (its signed manifest)
    UNTIED = "untied"  # the config, set for another model, as the serving one has none
    DEFAULT = "default"  # no config and no recommendation: the built-in default


@dataclass(frozen=True)
class ThresholdsInForce:
    """The thresholds the edge decides with now, and where they come from.

    ``config_version`` is the config in force (0: none) and ``tied_to`` the model version
    its thresholds were set for; ``model`` is the serving model (issue "The closed loop":
    a rollout moves model and thresholds together).
    """

    default_threshold: float
    class_thresholds: Mapping[str, float] = field(default_factory=dict)
    source: ThresholdSource = ThresholdSource.DEFAULT
    config_version: int = 0
    tied_to: str | None = None
    model: str = ""

    def threshold_for(self, class_name: str) -> float:
        return self.class_thresholds.get(class_name, self.default_threshold)

    def describe(self) -> dict[str, object]:
        """For the local API's status (plain JSON values)."""
        return {
            "source": self.source.value,
            "default_threshold": self.default_threshold,
            "class_thresholds": dict(self.class_thresholds),
            "config_version": self.config_version,
            "tied_to": self.tied_to,
            "model": self.model,
        }


def thresholds_in_force(
    config: EdgeConfig | None, manifest: ModelManifest | None, default_threshold: float = 0.5
) -> ThresholdsInForce:
    """Which thresholds apply to ``manifest``'s model under ``config``.

    The config's when it is tied to no model or to the serving one; otherwise the
    serving model's recommended thresholds when its manifest has them; otherwise the
    config's still (an *untied* fallback: better an operator's threshold for another
    version than none). Without a config, the model's recommendation or the default.
    A model swap (deploy, restore, local rollback) thus changes the thresholds in force
    with no new config.
    """
    ref = "" if manifest is None else manifest.ref
    recommended = None if manifest is None else manifest.thresholds
    if config is None:
        if recommended is not None:
            return ThresholdsInForce(
                recommended.default_threshold,
                dict(recommended.class_thresholds),
                ThresholdSource.MODEL,
                model=ref,
            )
        return ThresholdsInForce(default_threshold, {}, ThresholdSource.DEFAULT, model=ref)
    tied = config.model
    if tied is None or tied == ref or manifest is None:
        source = ThresholdSource.CONFIG
    elif recommended is not None:
        return ThresholdsInForce(
            recommended.default_threshold,
            dict(recommended.class_thresholds),
            ThresholdSource.MODEL,
            config.version,
            tied,
            ref,
        )
    else:
        source = ThresholdSource.UNTIED
    return ThresholdsInForce(
        config.default_threshold,
        dict(config.class_thresholds),
        source,
        config.version,
        tied,
        ref,
    )


class Thresholds(Protocol):
    """What :func:`decide` needs: an :class:`EdgeConfig` or :class:`ThresholdsInForce`."""

    @property
    def default_threshold(self) -> float: ...

    def threshold_for(self, class_name: str) -> float: ...


@dataclass(frozen=True)
class Decision:
    decision: str  # "accept" | "reject"
    threshold: float  # the threshold that decided
    deciding_class: str


def decide(
    scores: dict[str, float],
    positive_classes: tuple[str, ...],
    config: Thresholds | None,
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

"""What an alert's condition or a rollout's abort criterion means, in words (issue 30,
item 6): which figure it is, which direction is bad, and how serious it is.

Pure: a condition's name in, its description out. The figures are the ones the monitor
(edge_manager/monitor/rules.py) and the rollout's health (edge_manager/rollout/health.py)
compute; this module only says them plainly, so an operator reading "0.41 / 0.2" knows
it is a PSI above its alert level and that higher is worse.
"""

from dataclasses import dataclass
from enum import IntEnum


class Severity(IntEnum):
    """How soon someone should look: the higher, the sooner."""

    LOW = 1
    MEDIUM = 2
    HIGH = 3

    @property
    def word(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Condition:
    name: str  # readable: "input drift"
    means: str  # what the figure is
    worse: str  # "higher" or "lower": which direction is bad
    severity: Severity
    figure: str = "value"  # what the number is called: "PSI", "estimated accuracy"

    def reading(self, value: float, threshold: float) -> str:
        """'PSI 0.41, over the alert level 0.2 (higher is worse)'."""
        side = "over" if self.worse == "higher" else "under"
        return (
            f"{self.figure} {value:.3g}, {side} the limit {threshold:.3g} ({self.worse} is worse)"
        )


ALERTS: dict[str, Condition] = {
    "input_drift": Condition(
        "input drift",
        "the images' statistics (brightness, contrast, sharpness...) moved away from the "
        "model's reference window at this station: the lighting, the camera or the parts "
        "changed, and the model sees images it was not judged on",
        "higher",
        Severity.MEDIUM,
        "largest PSI of a drifted feature",
    ),
    "score_drift": Condition(
        "score drift",
        "the model's scores (top score, margin, entropy) moved away from its reference "
        "window: it is less sure, or sure of other things, than when it was judged",
        "higher",
        Severity.MEDIUM,
        "largest PSI of a drifted feature",
    ),
    "accuracy_estimate": Condition(
        "estimated accuracy low",
        "the label-free (MPP) estimate of the model's accuracy over its newest window is "
        "under the minimum: it is probably deciding wrongly more often",
        "lower",
        Severity.HIGH,
        "estimated accuracy",
    ),
    "local_rollback": Condition(
        "station rolled back on its own",
        "after the rollout completed, the station's own probation checks failed and it "
        "went back to its previous model: the fleet serves two versions until an operator "
        "decides (abort the rollout to send the others back too)",
        "higher",
        Severity.HIGH,
        "rolled back (1: yes)",
    ),
}

CRITERIA: dict[str, Condition] = {
    "failed_activation": Condition(
        "failed activation",
        "the station could not load or smoke-test the new model, rolled it back on its "
        "own, or did not report it active in time (1: it did; a failed activation always "
        "aborts)",
        "higher",
        Severity.HIGH,
    ),
    "error_rate": Condition(
        "inference error rate",
        "inference errors over images attempted since the station moved",
        "higher",
        Severity.HIGH,
        "error rate",
    ),
    "latency_p95_ms": Condition(
        "latency p95",
        "the 95th percentile of the new model's inference time on the station, in ms",
        "higher",
        Severity.MEDIUM,
        "p95 ms",
    ),
    "agreement_drop": Condition(
        "label agreement drop",
        "the previous model's agreement with operators' labels minus the new model's on "
        "the same station: the new model decides against the labels more often",
        "higher",
        Severity.HIGH,
        "drop",
    ),
    "alerts": Condition(
        "open alerts",
        "open alerts about the new model raised on the station since it moved",
        "higher",
        Severity.HIGH,
        "alerts",
    ),
    "est_accuracy_drop": Condition(
        "estimated accuracy drop",
        "the previous model's label-free accuracy estimate minus the new model's",
        "higher",
        Severity.HIGH,
        "drop",
    ),
    "probation_timeout": Condition(
        "no probation verdict",
        "the station activated the model but gave no verdict on its probation in time",
        "higher",
        Severity.MEDIUM,
    ),
}


def alert_condition(kind: str) -> Condition:
    """The meaning of an alert ``kind`` (one this console does not know: said so)."""
    return ALERTS.get(
        kind,
        Condition(kind.replace("_", " "), f"a {kind!r} alert (unknown to this console)",
                  "higher", Severity.MEDIUM),
    )  # fmt: skip


def criterion(metric: str) -> Condition:
    """The meaning of a rollout abort metric."""
    return CRITERIA.get(
        metric,
        Condition(metric.replace("_", " "), f"the rollout criterion {metric!r}", "higher",
                  Severity.MEDIUM),
    )  # fmt: skip


# Rollout and edge states as an operator reads them (issue 30, item 7: readable names).
STATE_WORDS = {
    "rolled_back": "rolled back",
    "rolling_back": "rolling back",
    "unconfirmed": "sent back, never confirmed",
    "never-seen": "never seen",
    "waiting": "waiting for its wave",
    "moved": "moved",
}


def readable(state: str) -> str:
    """A stored state name in words: 'rolled_back' -> 'rolled back'."""
    return STATE_WORDS.get(state, state.replace("_", " "))

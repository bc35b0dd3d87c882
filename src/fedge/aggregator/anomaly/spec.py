"""``[anomaly]`` of a fleet job whose ``[task] family = "anomaly"`` (issue 28): pure parsing.

::

    [task]
    model = "inspect:3"        # the inspection CNN whose feature layers are the backbone
    family = "anomaly"

    [anomaly]                  # optional (defaults shown)
    stages = 1                 # the backbone's conv stages (1-3)
    input_scale = 20.0         # 0: the classifier's per-image normalisation
    clip = 0.0                 # per-location feature clip (0: none); bounds a mislabelled part
    good_class = "clean"       # the label that makes a part "good"
    false_alarm_rate = 0.01    # each station's threshold: this rate on its held-out good parts

An anomaly job is one round of sums, never epochs: ``job.rounds`` must be 1 and the
strategy FedAvg (the weighted mean of each station's per-part moments, with its count as
the weight, is the pooled moments exactly). Privacy is refused until the DP release of
statistics (:mod:`fedge.models.anomaly.private`) is accounted in a station's ledger here.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedge.aggregator.jobs.spec import ManifestError
from fedge.toml_table import TomlTable

ANOMALY_FAMILY = "anomaly"
CLASSIFIER_FAMILY = "classifier"
FAMILIES = (CLASSIFIER_FAMILY, ANOMALY_FAMILY)
ANOMALY_KEYS = frozenset(("stages", "input_scale", "clip", "good_class", "false_alarm_rate"))


@dataclass(frozen=True)
class AnomalySpec:
    """How the stations compute their statistics and thresholds."""

    stages: int = 1
    input_scale: float = 20.0
    clip: float = 0.0
    good_class: str = "clean"
    false_alarm_rate: float = 0.01

    def to_config(self) -> dict[str, str | float | int]:
        """The ``anomaly-*`` keys a station reads (:mod:`fedge.party.anomaly_round`)."""
        return {
            "anomaly-stages": self.stages,
            "anomaly-input-scale": self.input_scale,
            "anomaly-clip": self.clip,
            "anomaly-good-class": self.good_class,
            "anomaly-false-alarm-rate": self.false_alarm_rate,
        }


def parse_anomaly(table: TomlTable | None) -> AnomalySpec:
    """``[anomaly]`` (None: the defaults); a bad value names its field."""
    if table is None:
        return AnomalySpec()
    stages = table.integer("stages", minimum=1, default=1)
    if stages > 3:
        raise ManifestError(f"anomaly.stages must be 1, 2 or 3, got {stages}")
    input_scale = table.number("input_scale", 20.0)
    clip = table.number("clip", 0.0)
    rate = table.number("false_alarm_rate", 0.01)
    for key, value in (("input_scale", input_scale), ("clip", clip)):
        if not value >= 0:
            raise ManifestError(f"anomaly.{key} must be >= 0, got {value}")
    if not 0 < rate < 1:
        raise ManifestError(f"anomaly.false_alarm_rate must be in (0, 1), got {rate}")
    return AnomalySpec(
        stages=stages,
        input_scale=input_scale,
        clip=clip,
        good_class=table.text("good_class", "clean", non_empty=True),
        false_alarm_rate=rate,
    )


def check_anomaly_job(rounds: int, kind: str, params: dict[str, object]) -> None:
    """An anomaly job is one FedAvg round of sums, without privacy (module docstring)."""
    if rounds != 1:
        raise ManifestError(
            f"job.rounds must be 1 for an anomaly job (one round of sums, no epochs), got {rounds}"
        )
    if kind != "fedavg":
        raise ManifestError(
            f'strategy.kind must be "fedavg" for an anomaly job (the stations\' moments are '
            f"averaged by their counts), got {kind!r}"
        )
    if params:
        raise ManifestError(
            f"an anomaly job takes no strategy parameters or [privacy] yet, got "
            f"{', '.join(sorted(params))}"
        )

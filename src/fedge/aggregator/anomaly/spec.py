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
    false_alarm_rate = 0.01    # each station's threshold: this rate on its good parts scored
                               # out of sample (conformal: >= 1/rate - 1 of them, 99 at 1 %)

An anomaly job is one round of sums, never epochs: ``job.rounds`` must be 1 and the
strategy FedAvg (the weighted mean of each station's per-part moments, with its count as
the weight, is the pooled moments exactly).

``[privacy]`` (the classifier jobs' table; :func:`anomaly_privacy`) takes one of two forms,
both needing ``[anomaly] clip > 0`` (the bound on one part's features that each needs)::

    [privacy]
    secagg = true              # SecAgg+ adds the stations' moments (Bell et al., CCS 2020)
    secagg_threshold = 0.5     # optional, as for classifier jobs

    [privacy]
    mode = "local"             # each station releases its statistics with the Gaussian
    noise_multiplier = 1.0     # mechanism (fedge.models.anomaly.private), or epsilon = 4.0
    delta = 1e-5               # optional; the station's floor may lower it

Under SecAgg+ the clipping and quantisation ranges are chosen from the clip and the number
of stations (:mod:`fedge.aggregator.anomaly.secure`, which states the bound), so
``secagg_clipping_range`` and ``secagg_quantization_range`` are refused. Under DP the
release is clipped by ``[anomaly] clip`` (``privacy.clipping_norm`` is DP-SGD's and is
refused) and is one release per job (``rounds_per_party`` refused). Refused: central DP
(the server would see each station's raw statistics) and DP together with SecAgg+ (the
noisy moments have no bound to choose SecAgg+'s clipping range from).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from fedge.aggregator.jobs.spec import ManifestError
from fedge.privacy.settings import PrivacyError, PrivacyMode, PrivacySpec
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
    privacy: PrivacySpec = field(default_factory=PrivacySpec)
    """SecAgg+ or the stations' DP release (:func:`anomaly_privacy`); none by default."""

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
    """An anomaly job is one FedAvg round of sums; ``[privacy]`` is its only parameter
    (checked with the spec by :func:`anomaly_privacy`)."""
    if rounds != 1:
        raise ManifestError(
            f"job.rounds must be 1 for an anomaly job (one round of sums, no epochs), got {rounds}"
        )
    if kind != "fedavg":
        raise ManifestError(
            f'strategy.kind must be "fedavg" for an anomaly job (the stations\' moments are '
            f"averaged by their counts), got {kind!r}"
        )
    others = sorted(set(params) - {"privacy"})
    if others:
        raise ManifestError(
            f"an anomaly job takes no strategy parameters (only [privacy]), got {', '.join(others)}"
        )


_DERIVED = {
    "clipping_norm": "the DP release is clipped by [anomaly] clip",
    "rounds_per_party": "an anomaly job is one release per station",
    "secagg_clipping_range": "SecAgg+'s ranges are chosen from [anomaly] clip",
    "secagg_quantization_range": "SecAgg+'s ranges are chosen from [anomaly] clip",
}


def anomaly_privacy(spec: AnomalySpec, table: Mapping[str, object] | None) -> AnomalySpec:
    """``spec`` with the job's ``[privacy]`` (module docstring); what it cannot honour is
    refused, naming the field."""
    if table is None:
        return spec
    if not isinstance(table, Mapping):
        raise ManifestError(f"privacy must be a table, got {table!r}")
    for key, why in _DERIVED.items():
        if key in table:
            raise ManifestError(f"privacy.{key} is not for an anomaly job: {why}")
    try:
        privacy = PrivacySpec.from_table(table)
    except PrivacyError as exc:
        raise ManifestError(str(exc)) from None
    if privacy.mode is PrivacyMode.CENTRAL:
        raise ManifestError(
            'privacy.mode = "central" would show the server each station\'s raw statistics: '
            'use mode = "local" (each station adds the noise) or secagg = true'
        )
    local = privacy.mode is PrivacyMode.LOCAL
    if local and privacy.secagg:
        raise ManifestError(
            'privacy: mode = "local" and secagg = true together are not supported for anomaly '
            "jobs (the noisy moments have no bound to choose SecAgg+'s clipping range from); "
            "choose one"
        )
    if (local or privacy.secagg) and not spec.clip > 0:
        raise ManifestError(
            f"anomaly.clip must be > 0 under [privacy] (got {spec.clip}): "
            + ("SecAgg+'s quantisation range" if privacy.secagg else "the DP release's sensitivity")
            + " is chosen from it"
        )
    return replace(spec, privacy=privacy)

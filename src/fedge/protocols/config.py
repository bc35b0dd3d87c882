"""Per-edge configuration: the desired document the cloud retains, and the edge's report.

Modelled on device twins (AWS shadow ``version``, Azure ``$version``): a full document with a
monotonic version, never a patch, so an edge that was offline converges from the retained
copy alone (see ../shared/research/edge-fleet-protocols.md, section 0).
"""

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError
from fedge.protocols.thumbnails import ThumbnailPolicy


@dataclass(frozen=True)
class TrainingPolicy:
    """Whether, and how hard, a station trains as a federated party (operator-set).

    ``max_minutes`` caps one round's local training; ``threads`` caps the CPU threads the
    training process may use, so inference on the same device keeps its cores.
    """

    enabled: bool = False
    max_minutes: float = 10.0
    threads: int = 1
    # Optional (issue 31), absent on the wire while None: when the manager's job
    # scheduler may place jobs here -- shifts "HH:MM-HH:MM" in the station's local time
    # (``utc_offset_minutes`` east of UTC) and/or "idle Nm", once the line has scored
    # nothing for N minutes. Any one open window suffices; absent: any time.
    windows: tuple[str, ...] | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    utc_offset_minutes: int | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.finite(self.max_minutes, "training.max_minutes", minimum=0.1)
        if self.max_minutes > 24 * 60:
            raise ValidationError(f"training.max_minutes must be <= 1440, got {self.max_minutes}")
        if not 1 <= self.threads <= 256:
            raise ValidationError(f"training.threads must be in [1, 256], got {self.threads}")
        for window in self.windows or ():
            if not (_SHIFT.fullmatch(window) or _IDLE.fullmatch(window)):
                raise ValidationError(
                    f"training.windows: {window!r} is neither a shift (HH:MM-HH:MM, e.g. "
                    "22:00-06:00) nor an idle window (idle Nm, e.g. idle 30m)"
                )
        if self.windows is not None and not self.windows:
            raise ValidationError("training.windows is empty; leave it out to train any time")
        offset = self.utc_offset_minutes
        if offset is not None and not -14 * 60 <= offset <= 14 * 60:
            raise ValidationError(
                f"training.utc_offset_minutes must be within +-840, got {self.utc_offset_minutes}"
            )


_SHIFT = re.compile(r"([01]\d|2[0-3]):[0-5]\d-(([01]\d|2[0-3]):[0-5]\d|24:00)")
_IDLE = re.compile(r"idle [1-9]\d{0,3}m")


@dataclass(frozen=True)
class PrivacyBudget:
    """A station's lifetime differential-privacy bound (operator-set, issue 12).

    Every job's DP-SGD rounds on the station together may spend at most ``epsilon`` at
    ``delta``; the station's ClientApp refuses a round that would go past it. The agent
    keeps it in the station's budget ledger, beside the epsilon already spent.
    """

    epsilon: float
    delta: float = 1e-3

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValidationError(
                f"privacy.epsilon must be a finite number > 0, got {self.epsilon!r}"
            )
        if not (math.isfinite(self.delta) and 0 < self.delta < 1):
            raise ValidationError(f"privacy.delta must be in (0, 1), got {self.delta!r}")


@dataclass(frozen=True)
class EdgeConfig:
    """What an edge should run with. Thresholds apply to the score of the positive class(es)."""

    fleet: str
    edge: str
    version: int
    default_threshold: float = 0.5
    # Per-class thresholds override the default for that class's score.
    class_thresholds: dict[str, float] = field(default_factory=dict)
    # Settings an operator can tune without a new model (all optional).
    report_interval_s: float = 5.0
    batch_max_records: int = 500
    issued_at: float = 0.0
    # Optional extension (absent on the wire while None): local training as a party.
    training: TrainingPolicy | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    # The model version ("inspect:4") the thresholds above were set for, so that a
    # rollout moves model and thresholds together. An edge serving another model applies
    # that model's recommended thresholds (its manifest) when it has them, else these.
    model: str | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    # Optional extension: the station's lifetime privacy budget (None: no lifetime bound;
    # each job's own target still holds). An agent without it refuses such a config.
    privacy: PrivacyBudget | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    # Optional extension: the station shares thumbnails of what it scores (None: its
    # images stay on the station, the default). An agent without it refuses such a config.
    thumbnails: ThumbnailPolicy | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    # Optional extension (issue 30): operators may view this station's images on demand,
    # fetched from the station through the manager over mutual TLS and never stored there
    # (protocols/viewing.py). Only True is sent; absent (None): off, the default. The
    # agent enforces it from its own signed copy. An agent without it refuses such a config.
    operator_viewing: bool | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    # When this signature stops counting (issue 24, protocols/freshness.py): the manager
    # re-signs the same version with a later expiry before then; a station refuses a
    # config that arrives expired. Absent on documents not (yet) stamped by `manager serve`.
    expires_at: float | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    # Optional extension (issue 28): the score over which the station's anomaly model
    # calls a part novel (a Mahalanobis distance, not a probability: > 0, no upper bound).
    # None: the anomaly model's scores are recorded, nothing is called novel. An agent
    # without it refuses such a config.
    anomaly_threshold: float | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    # The anomaly model (name:version) the threshold was set for: a refit moves every
    # score, so a station serving another anomaly model records its scores but calls
    # nothing novel until a threshold for it arrives. None: whichever it serves (a
    # threshold set before any anomaly model was deployed).
    anomaly_threshold_model: str | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        validate.identifier(self.edge, "edge")
        validate.positive(self.version, "version")
        if self.expires_at is not None:
            validate.finite(self.expires_at, "expires_at", minimum=0.0)
        if self.model is not None:
            validate.bounded_text(self.model, "model", 200)
        validate.probability(self.default_threshold, "default_threshold")
        validate.probability_map(self.class_thresholds, "class_thresholds")
        validate.finite(self.report_interval_s, "report_interval_s", minimum=0.05)
        if not 1 <= self.batch_max_records <= 10_000:
            raise ValidationError(
                f"batch_max_records must be in [1, 10000], got {self.batch_max_records}"
            )
        validate.finite(self.issued_at, "issued_at", minimum=0.0)
        if self.operator_viewing is False:
            raise ValidationError("operator_viewing is sent only as true; leave it out for off")
        if self.anomaly_threshold is not None:
            validate.finite(self.anomaly_threshold, "anomaly_threshold", minimum=0.0)
            if self.anomaly_threshold == 0:
                raise ValidationError("anomaly_threshold must be > 0 (a distance)")
        if self.anomaly_threshold_model is not None:
            validate.bounded_text(self.anomaly_threshold_model, "anomaly_threshold_model", 200)
            if self.anomaly_threshold is None:
                raise ValidationError("anomaly_threshold_model without an anomaly_threshold")

    def anomaly_threshold_for(self, anomaly_model: str) -> float | None:
        """The anomaly threshold in force for ``anomaly_model`` (name:version), if any."""
        tied = self.anomaly_threshold_model
        return self.anomaly_threshold if tied is None or tied == anomaly_model else None

    def threshold_for(self, class_name: str) -> float:
        return self.class_thresholds.get(class_name, self.default_threshold)


class ConfigStatus(StrEnum):
    APPLIED = "applied"
    REJECTED = "rejected"


@dataclass(frozen=True)
class ConfigReport:
    """The edge's answer to a desired document: the version in force, or why one was refused.

    ``applied_version`` is always the version the edge runs with (0 = none yet), so a rejection
    still says what is in force.
    """

    edge: str
    status: ConfigStatus
    applied_version: int
    offered_version: int
    reason: str = ""
    reported_at: float = 0.0

    def __post_init__(self) -> None:
        validate.identifier(self.edge, "edge")
        validate.u64(self.applied_version, "applied_version")
        validate.u64(self.offered_version, "offered_version")
        validate.bounded_text(self.reason, "reason", 1024)

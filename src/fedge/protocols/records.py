"""What edges report: telemetry, predictions and labels, in numbered batches.

Every batch carries the edge's ``session`` and a 64-bit ``seq`` per stream that survives
restarts (persisted on the edge), so the manager stores each (edge, stream, seq) once and
can tell "agent restarted" from "messages lost" -- the gap Sparkplug's 8-bit seq leaves open.
"""

from dataclasses import dataclass, field
from enum import StrEnum

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError
from fedge.protocols.thumbnails import PER_BATCH, ThumbnailRecord


class Stream(StrEnum):
    TELEMETRY = "telemetry"
    PREDICTIONS = "predictions"
    LABELS = "labels"
    # Only from a station whose config shares thumbnails (protocols.thumbnails).
    THUMBNAILS = "thumbnails"


@dataclass(frozen=True)
class MetricRecord:
    name: str
    value: float
    at: float

    def __post_init__(self) -> None:
        validate.bounded_text(self.name, "metric name", 128)
        validate.finite(self.value, f"metric {self.name!r}")


@dataclass(frozen=True)
class AnomalyScore:
    """The anomaly model's view of a scored part, served beside the classifier (issue 28).

    ``threshold`` is the station's anomaly threshold in force when it was scored (None:
    none set, so no part is called novel).
    """

    model: str  # "name:version" of the anomaly model
    score: float  # the largest Mahalanobis distance over feature locations
    threshold: float | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.bounded_text(self.model, "anomaly model", 200)
        validate.finite(self.score, "anomaly score", minimum=0.0)
        if self.threshold is not None:
            validate.finite(self.threshold, "anomaly threshold", minimum=0.0)


@dataclass(frozen=True)
class PredictionRecord:
    prediction_id: str
    at: float
    model: str  # "name:version"
    scores: dict[str, float]
    decision: str  # "accept" | "reject"
    threshold: float
    config_version: int
    latency_ms: float
    source: str = ""
    # Statistics of the scored image (monitoring.features.image_stats), for drift and
    # label-free accuracy at the manager; left out by agents from before they existed.
    stats: dict[str, float] | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    # The anomaly model's score where the deployment carries one (issue 28); left out
    # otherwise, so a manager of before decodes every station that serves no such model.
    anomaly: AnomalyScore | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    @property
    def novel(self) -> bool:
        """The classifier called the part clean, but its anomaly score is over the
        station's anomaly threshold: a defect nobody labelled yet, perhaps (issue 28)."""
        anomaly = self.anomaly
        return (
            self.decision == "accept"
            and anomaly is not None
            and anomaly.threshold is not None
            and anomaly.score > anomaly.threshold
        )

    def __post_init__(self) -> None:
        validate.identifier(self.prediction_id, "prediction_id")
        validate.bounded_text(self.model, "model", 200)
        validate.probability_map(self.scores, "scores")
        if self.decision not in ("accept", "reject"):
            raise ValidationError(f"decision must be 'accept' or 'reject', got {self.decision!r}")
        validate.probability(self.threshold, "threshold")
        validate.u64(self.config_version, "config_version")
        validate.finite(self.latency_ms, "latency_ms", minimum=0.0)
        validate.bounded_text(self.source, "source", 512)
        if self.stats is not None:
            _check_stats(self.stats)


MAX_STATS = 16
"""Image statistics per prediction: a handful of numbers, never a payload of its own."""


# Stat names already checked: every prediction carries the same handful, and the agent
# builds and the manager decodes thousands a second (bounded: a sender cannot grow it).
_CHECKED_KEYS: set[str] = set()


def _check_stats(stats: dict[str, float]) -> None:
    if len(stats) > MAX_STATS:
        raise ValidationError(f"stats has {len(stats)} entries, limit {MAX_STATS}")
    for key, value in stats.items():
        if key not in _CHECKED_KEYS:
            validate.identifier(key, "stats key")
            if len(_CHECKED_KEYS) < 64:
                _CHECKED_KEYS.add(key)
        validate.finite(value, f"stats[{key!r}]")


@dataclass(frozen=True)
class LabelRecord:
    label_id: str
    prediction_id: str
    label: str
    who: str
    at: float

    def __post_init__(self) -> None:
        validate.identifier(self.label_id, "label_id")
        validate.identifier(self.prediction_id, "prediction_id")
        validate.identifier(self.label, "label")
        validate.bounded_text(self.who, "who", 128)


Record = MetricRecord | PredictionRecord | LabelRecord | ThumbnailRecord

RECORD_TYPE: dict[Stream, type[Record]] = {
    Stream.TELEMETRY: MetricRecord,
    Stream.PREDICTIONS: PredictionRecord,
    Stream.LABELS: LabelRecord,
    Stream.THUMBNAILS: ThumbnailRecord,
}

# Records per batch where a record is large: the batch stays under the codec's limit.
BATCH_LIMIT: dict[Stream, int] = {Stream.THUMBNAILS: PER_BATCH}


@dataclass(frozen=True)
class RecordBatch:
    edge: str
    stream: Stream
    session: int
    seq: int
    records: tuple[Record, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        validate.identifier(self.edge, "edge")
        validate.u64(self.session, "session")
        validate.u64(self.seq, "seq")
        limit = BATCH_LIMIT.get(self.stream, 10_000)
        if len(self.records) > limit:
            raise ValidationError(
                f"{self.stream.value} batch of {len(self.records)} records, limit {limit}"
            )
        expected = RECORD_TYPE[self.stream]
        for record in self.records:
            if type(record) is not expected:
                raise ValidationError(
                    f"stream {self.stream.value!r} carries {expected.__name__}, "
                    f"got {type(record).__name__}"
                )

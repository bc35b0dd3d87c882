"""What edges report: telemetry, predictions and labels, in numbered batches.

Every batch carries the edge's ``session`` and a 64-bit ``seq`` per stream that survives
restarts (persisted on the edge), so the manager stores each (edge, stream, seq) once and
can tell "agent restarted" from "messages lost" -- the gap Sparkplug's 8-bit seq leaves open.
"""

from collections.abc import Mapping
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


# A classifier that rejects a part with a top class probability under this level does not
# recognise it as a known defect (``PredictionRecord.novel``). Chosen on the anomaly
# bench's seed 1 (which its novel-defect streams, seed 0, do not use): at 0.9 the
# anomalous rejects under the level were 30 % of dents and 0.6 % of scratches; at 0.95,
# 37 % and 1.6 % (BENCHMARKS.md §22).
NOVEL_CONFIDENCE = 0.9


def is_novel(
    decision: str, scores: Mapping[str, float], score: float | None, threshold: float | None
) -> bool:
    """:attr:`PredictionRecord.novel` from its parts (a record read as plain JSON): an
    anomaly score over the threshold, and the part called clean or rejected without
    confidence (no class scores: taken as confident)."""
    if score is None or threshold is None or score <= threshold:
        return False
    return decision == "accept" or max(scores.values(), default=1.0) < NOVEL_CONFIDENCE


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
        """The anomaly model finds the part unlike the station's good parts (its score
        over the station's anomaly threshold), and the classifier does not recognise it
        as a known defect: it called it clean, or rejected it without confidence (its
        top class probability under :data:`NOVEL_CONFIDENCE`). A defect nobody labelled
        yet, perhaps (issue 28).

        Open-set recognition: a classifier knows only its classes, and a part of a new
        kind lands in whichever one is nearest, with a lower top probability than the
        parts it was trained on -- the maximum softmax probability as the signal
        (Hendrycks & Gimpel, ICLR 2017; Bendale & Boult, CVPR 2016). A dent the
        scratch classifier rejects at 0.7 is still one to label; a scratch it rejects at
        0.99 is a known defect, however high its anomaly score.
        """
        anomaly = self.anomaly
        if anomaly is None:
            return False
        return is_novel(self.decision, self.scores, anomaly.score, anomaly.threshold)

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

"""Station-side evaluation for the validation gate: the request down, the report up.

The gate compares a candidate model with the model a station serves on the station's
held-out labelled images, and the images never leave the station (issue "The closed
loop"). So the manager sends a signed desired document, :class:`EvaluationRequest`,
retained on ``down/evaluate`` like a deployment: the registry's signed manifests of the
models to score (the candidate, and the edge's serving model when it has one). The
station downloads and verifies them as a deployment does, without activating anything,
scores its held-out labelled images with each, and answers with an
:class:`EvaluationReport` on ``up/evaluate``: per image and model the class scores, the
label the station has and a few image statistics -- never the image. The manager scores
accuracy against its own labels and decides.

The station also scores ``augment`` re-lit copies of each held-out image
(:func:`fedge.monitoring.relight.relit_copies`; :data:`DEFAULT_AUGMENT` when the request
leaves it unset, 0 for none), reported as items with ``augmented`` set to the copy's
index: the manager fits its label-free accuracy predictor (MPP) on them as well, while
the gate's comparison uses the images as they are only. Both fields are optional
extensions (left out of the wire form while unset), so an older station still decodes a
request that does not set ``augment``, and a report without copies decodes everywhere.

Sizes are bounded so that a report always fits the codec's 256 KiB limit: at most
:data:`MAX_IMAGES` images, :data:`MAX_MODELS` models and :data:`MAX_AUGMENT` copies per
request; the station drops re-lit copies (oldest images first), then its oldest images,
from a report that would still be too large (e.g. many classes).
"""

from dataclasses import dataclass, field
from enum import StrEnum

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError

MAX_MODELS = 2
MAX_IMAGES = 200
MAX_AUGMENT = 4
DEFAULT_AUGMENT = 2  # re-lit copies per held-out image when the request does not say
MAX_ITEMS = MAX_MODELS * MAX_IMAGES * (1 + MAX_AUGMENT)
MAX_STATS = 16
MAX_CLASSES = 64
MAX_ENVELOPE_CHARS = 64 * 1024


def check_model_ref(ref: str, what: str = "model") -> tuple[str, int]:
    """``"inspect:4"`` -> ``("inspect", 4)``; a ValidationError for anything else."""
    name, sep, version = ref.rpartition(":")
    if not sep or not version.isdigit() or len(version) > 19:
        raise ValidationError(f"{what} {ref[:80]!r} is not NAME:VERSION")
    validate.identifier(name, f"{what} name")
    validate.positive(int(version), f"{what} version")
    return name, int(version)


@dataclass(frozen=True)
class EvaluationRequest:
    """Retained per edge on ``down/evaluate``; signed as a whole by the manager.

    ``manifest_envelopes`` are the registry's signed manifests, verbatim: the candidate
    first, then the model the edge serves (absent when it serves none, or serves the
    candidate). ``eval_id`` names the gate's evaluation across all its edges.
    """

    fleet: str
    edge: str
    version: int
    eval_id: str
    manifest_envelopes: tuple[str, ...]
    grpc_target: str = ""
    max_images: int = MAX_IMAGES
    issued_at: float = 0.0
    # Re-lit copies per held-out image (0: none); None: the station's DEFAULT_AUGMENT.
    augment: int | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        validate.identifier(self.edge, "edge")
        validate.positive(self.version, "version")
        validate.identifier(self.eval_id, "eval_id")
        if not 1 <= len(self.manifest_envelopes) <= MAX_MODELS:
            raise ValidationError(
                f"an evaluation scores 1 to {MAX_MODELS} models, got {len(self.manifest_envelopes)}"
            )
        if len(set(self.manifest_envelopes)) != len(self.manifest_envelopes):
            raise ValidationError("the same model is named twice")
        for index, envelope in enumerate(self.manifest_envelopes):
            validate.bounded_text(envelope, f"manifest_envelopes[{index}]", MAX_ENVELOPE_CHARS)
        validate.bounded_text(self.grpc_target, "grpc_target", 256)
        if not 1 <= self.max_images <= MAX_IMAGES:
            raise ValidationError(f"max_images must be in [1, {MAX_IMAGES}], got {self.max_images}")
        validate.finite(self.issued_at, "issued_at", minimum=0.0)
        if self.augment is not None and not 0 <= self.augment <= MAX_AUGMENT:
            raise ValidationError(f"augment must be in [0, {MAX_AUGMENT}], got {self.augment}")

    @property
    def copies(self) -> int:
        """Re-lit copies the station scores per held-out image."""
        return DEFAULT_AUGMENT if self.augment is None else self.augment


class EvaluationStatus(StrEnum):
    DONE = "done"
    FAILED = "failed"  # ``reason`` says why; no items


@dataclass(frozen=True)
class EvaluationItem:
    """One model's scores on one held-out labelled image of the station."""

    prediction_id: str
    model: str  # "name:version"
    label: str  # the label the station has (the manager scores against its own)
    scores: dict[str, float]
    # monitoring.features.image_stats of the input as this model prepared it.
    stats: dict[str, float] = field(default_factory=dict)
    # None: the image as it is; k: its k-th re-lit copy (monitoring.relight), same label.
    augmented: int | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.prediction_id, "prediction_id")
        if self.augmented is not None and not 1 <= self.augmented <= MAX_AUGMENT:
            raise ValidationError(
                f"augmented must be a copy index in [1, {MAX_AUGMENT}], got {self.augmented}"
            )
        check_model_ref(self.model)
        validate.identifier(self.label, "label")
        if not 1 <= len(self.scores) <= MAX_CLASSES:
            raise ValidationError(f"scores has {len(self.scores)} classes, 1 to {MAX_CLASSES}")
        validate.probability_map(self.scores, "scores")
        if len(self.stats) > MAX_STATS:
            raise ValidationError(f"stats has {len(self.stats)} entries, limit {MAX_STATS}")
        for key, value in self.stats.items():
            validate.identifier(key, "stats key")
            validate.finite(value, f"stats[{key!r}]")


@dataclass(frozen=True)
class EvaluationReport:
    """A station's answer to one :class:`EvaluationRequest` (retained on ``up/evaluate``).

    ``version`` is the request's version; ``holdout`` the number of held-out labelled
    images the station has (the items may cover fewer: ``max_images``, the size limit).
    """

    edge: str
    eval_id: str
    version: int
    status: EvaluationStatus
    reason: str = ""
    holdout: int = 0
    items: tuple[EvaluationItem, ...] = ()
    reported_at: float = 0.0

    def __post_init__(self) -> None:
        validate.identifier(self.edge, "edge")
        validate.identifier(self.eval_id, "eval_id")
        validate.positive(self.version, "version")
        validate.bounded_text(self.reason, "reason", 1024)
        if not 0 <= self.holdout <= 2**31:
            raise ValidationError(f"holdout must be in [0, 2^31], got {self.holdout}")
        if len(self.items) > MAX_ITEMS:
            raise ValidationError(f"{len(self.items)} items, limit {MAX_ITEMS}")
        if self.status is EvaluationStatus.FAILED and self.items:
            raise ValidationError("a failed evaluation carries no items")
        keys = {(item.prediction_id, item.model, item.augmented) for item in self.items}
        if len(keys) != len(self.items):
            raise ValidationError("an image (or copy) is scored twice by the same model")
        if len({item.model for item in self.items}) > MAX_MODELS:
            raise ValidationError(f"items name more than {MAX_MODELS} models")
        validate.finite(self.reported_at, "reported_at", minimum=0.0)

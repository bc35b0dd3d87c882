"""The model artifact manifest: what a model is, its hash and shape, and where it came from."""

from dataclasses import dataclass, field

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError

_DTYPES = frozenset({"float32", "float16", "float64", "int64", "int32", "uint8", "bool"})


@dataclass(frozen=True)
class TensorSpec:
    """One ONNX input or output. A dimension is an int, or a name for a dynamic axis."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def __post_init__(self) -> None:
        validate.bounded_text(self.name, "tensor name", 128)
        if self.dtype not in _DTYPES:
            raise ValidationError(f"tensor {self.name!r}: unsupported dtype {self.dtype!r}")
        if len(self.shape) > 8:
            raise ValidationError(f"tensor {self.name!r}: rank {len(self.shape)} > 8")


@dataclass(frozen=True)
class Lineage:
    """Which model and run produced this one (the audit trail an operator asks for)."""

    parent_version: int | None = None
    run_id: str | None = None
    data: str | None = None
    note: str = ""


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes the model's input: part of the model, not of the station.

    The input is ``[batch, channels, image_size, image_size]`` in NCHW order; a pixel of
    an 8-bit image becomes ``value * scale``. Training, distillation, the simulator and
    the agent all feed a model through this one description (``fedge.party.preprocess``),
    so a model and the way its images are prepared travel together.
    """

    image_size: int
    channels: int = 1
    scale: float = 1.0 / 255.0
    resample: str = "bilinear"

    def __post_init__(self) -> None:
        if not 1 <= self.image_size <= 4096:
            raise ValidationError(
                f"preprocess.image_size must be in [1, 4096], got {self.image_size}"
            )
        if self.channels not in (1, 3):
            raise ValidationError(f"preprocess.channels must be 1 or 3, got {self.channels}")
        validate.finite(self.scale, "preprocess.scale", minimum=0.0)
        if self.resample not in RESAMPLE_MODES:
            raise ValidationError(
                f"preprocess.resample must be one of {sorted(RESAMPLE_MODES)}, "
                f"got {self.resample!r}"
            )


RESAMPLE_MODES = frozenset({"bilinear", "bicubic", "nearest"})


@dataclass(frozen=True)
class Trainable:
    """The trainable form of a model, beside its ONNX artifact.

    ``family`` names the code that builds the network in torch (``fedge.party.families``:
    ``inspection-cnn``, ``digits-mlp``, or a user's entry point), ``params`` its size
    (e.g. ``{"width": 16}``); the weights are an ``.npz`` of the state dict, hashed like
    the ONNX file: a fleet job checks them against this signed manifest before its first
    round. (The rounds themselves travel over the SuperLink, unsigned; securing that
    channel is the transport-security work, not this manifest's.)
    """

    family: str
    params: dict[str, int]
    weights_sha256: str
    weights_size: int

    def __post_init__(self) -> None:
        validate.identifier(self.family, "trainable.family")
        for key in self.params:
            validate.identifier(key, "trainable.params key")
        validate.sha256_hex(self.weights_sha256, "trainable.weights_sha256")
        if not 0 < self.weights_size <= 4 * 2**30:
            raise ValidationError(
                f"trainable.weights_size must be in (0, 4 GiB], got {self.weights_size}"
            )


@dataclass(frozen=True)
class Thresholds:
    """Thresholds recommended with a model version (e.g. chosen on held-out data for a
    target recall): what an edge applies when it serves this model and its operator set
    no threshold for this model version (see ``EdgeConfig.model``)."""

    default_threshold: float
    class_thresholds: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def __post_init__(self) -> None:
        validate.probability(self.default_threshold, "thresholds.default_threshold")
        validate.probability_map(self.class_thresholds, "thresholds.class_thresholds")
        validate.bounded_text(self.note, "thresholds.note", 256)


@dataclass(frozen=True)
class ModelManifest:
    name: str
    version: int
    sha256: str
    size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # Names of the model's output classes, in score order; thresholds are keyed by them.
    classes: tuple[str, ...]
    # Classes whose score, at or above their threshold, makes the decision "reject" (a defect).
    positive_classes: tuple[str, ...] = ()
    created_at: float = 0.0
    lineage: Lineage = field(default_factory=Lineage)
    # Optional extensions (absent on the wire while None, so older agents still decode).
    preprocess: Preprocess | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    trainable: Trainable | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    thresholds: Thresholds | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)
    # The p95 inference latency the model must keep on a station after activation, or
    # the agent rolls back to its previous model (issue "The closed loop").
    latency_budget_ms: float | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.name, "model name")
        validate.positive(self.version, "model version")
        validate.sha256_hex(self.sha256)
        if not 0 < self.size <= 4 * 2**30:
            raise ValidationError(f"model size must be in (0, 4 GiB], got {self.size}")
        if not self.inputs or not self.outputs:
            raise ValidationError("a model needs at least one input and one output")
        if not self.classes:
            raise ValidationError("a model needs at least one class name")
        for name in self.classes:
            validate.identifier(name, "class name")
        unknown = set(self.positive_classes) - set(self.classes)
        if unknown:
            raise ValidationError(f"positive classes {sorted(unknown)} are not in classes")
        if self.preprocess is not None:
            _check_feedable(self.inputs[0], self.preprocess)
        if self.thresholds is not None:
            unknown = set(self.thresholds.class_thresholds) - set(self.classes)
            if unknown:
                raise ValidationError(f"thresholds for unknown classes {sorted(unknown)}")
        if self.latency_budget_ms is not None:
            validate.finite(self.latency_budget_ms, "latency_budget_ms", minimum=0.001)

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"


def _check_feedable(spec: TensorSpec, preprocess: Preprocess) -> None:
    """The input a preprocess spec makes must fit the model's first input (NCHW)."""
    wanted = (preprocess.channels, preprocess.image_size, preprocess.image_size)
    if len(spec.shape) != 4:
        raise ValidationError(
            f"input {spec.name!r} has rank {len(spec.shape)}; an image model takes NCHW"
        )
    for axis, (dim, need) in enumerate(zip(spec.shape[1:], wanted, strict=True), start=1):
        if isinstance(dim, int) and dim != need:
            raise ValidationError(
                f"input {spec.name!r} axis {axis} is {dim}, but preprocess makes {need} "
                f"(channels={preprocess.channels}, image_size={preprocess.image_size})"
            )

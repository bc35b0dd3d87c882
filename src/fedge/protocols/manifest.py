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

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

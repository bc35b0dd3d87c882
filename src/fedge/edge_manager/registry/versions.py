"""Model registry: immutable, signed model versions with lineage.

Publishing copies the artifact into the manager's home, hashes it, reads its ONNX spec,
and signs the manifest. A published (name, version) never changes: a second publish of
the same version is refused, so an edge that verified ``inspect:3`` once can trust it.
"""

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fedge.edge_manager.errors import RegistryError, UnknownModelError
from fedge.edge_manager.fleet.class_names import class_count_problem, unknown_class
from fedge.edge_manager.registry import store as model_store
from fedge.edge_manager.registry.onnx_spec import read_spec
from fedge.edge_manager.store import Store
from fedge.protocols import codec, validate
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import Lineage, ModelManifest, Preprocess, Thresholds, Trainable
from fedge.protocols.signing import SigningKey


@dataclass(frozen=True)
class ListedModel:
    """One published version as ``fedge model list`` and the console show it."""

    name: str
    version: int
    sha256: str
    size: int
    classes: tuple[str, ...]
    parent_version: int | None
    run_id: str | None
    created_at: float

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "ref": self.ref, "classes": list(self.classes)}


@dataclass(frozen=True)
class PublishedModel:
    manifest: ModelManifest
    envelope: bytes
    path: Path

    @property
    def weights_path(self) -> Path:
        """The trainable weights (``.npz``) beside the ONNX file, when the model has them."""
        return self.path.with_name(WEIGHTS_FILE)

    def verify(self) -> None:
        """Check the stored artifact (and weights, if any) against the signed manifest.

        Raises :class:`RegistryError` naming the model and what does not match, so a
        damaged registry copy is refused here rather than at every edge.
        """
        ref = self.manifest.ref
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            raise RegistryError(
                f"{ref}: its artifact {self.path} cannot be read ({exc.strerror}); "
                "publish the model again under a new version"
            ) from None
        if size != self.manifest.size:
            raise RegistryError(
                f"{ref}: the stored artifact {self.path} is {size} bytes but the signed "
                f"manifest says {self.manifest.size} (size mismatch): the registry copy is "
                "damaged; publish the model again under a new version"
            )
        digest = sha256_file(self.path)
        if digest != self.manifest.sha256:
            raise RegistryError(
                f"{ref}: the stored artifact {self.path} has sha256 {digest} but the signed "
                f"manifest says {self.manifest.sha256} (sha256 mismatch): the registry copy "
                "is damaged; publish the model again under a new version"
            )
        if self.manifest.trainable is not None:
            try:
                self.verified_weights()
            except OSError as exc:
                raise RegistryError(
                    f"{ref}: its weights {self.weights_path} cannot be read ({exc.strerror})"
                ) from None

    def verified_weights(self) -> bytes:
        """The trainable weights, checked against the signed manifest's size and hash."""
        trainable = self.manifest.trainable
        if trainable is None:
            raise RegistryError(
                f"{self.manifest.ref} has no trainable weights; publish it with --weights "
                "and --family to train it federatedly"
            )
        data = self.weights_path.read_bytes()
        if len(data) != trainable.weights_size or (
            hashlib.sha256(data).hexdigest() != trainable.weights_sha256
        ):
            raise RegistryError(
                f"{self.weights_path} does not match {self.manifest.ref}'s signed manifest "
                "(size or sha256): the registry copy is damaged"
            )
        return data


@dataclass(frozen=True)
class TrainableSource:
    """What makes a published model trainable: its weights file and the family that builds it."""

    weights: Path
    family: str
    params: dict[str, int]


WEIGHTS_FILE = "weights.npz"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def parse_ref(ref: str) -> tuple[str, int]:
    """``"inspect:3"`` -> ``("inspect", 3)``."""
    name, sep, version = ref.rpartition(":")
    if not sep or not name or not version.isdigit():
        raise RegistryError(f"model reference {ref!r} must look like NAME:VERSION, e.g. inspect:3")
    return name, int(version)


class Registry:
    def __init__(self, store: Store, artifacts: Path, key: SigningKey) -> None:
        self.store = store
        self.artifacts = artifacts
        self.key = key

    def publish(
        self,
        source: Path,
        *,
        name: str,
        version: int,
        classes: tuple[str, ...] | None = None,
        positive_classes: tuple[str, ...] | None = None,
        lineage: Lineage | None = None,
        preprocess: Preprocess | None = None,
        trainable: TrainableSource | None = None,
        thresholds: Thresholds | None = None,
        latency_budget_ms: float | None = None,
    ) -> PublishedModel:
        """Register ``source`` as ``name:version``, signed.

        ``thresholds`` are the thresholds recommended with this version (an edge serving
        it applies them unless its config is set for this version);
        ``latency_budget_ms`` is the p95 latency the model must keep after activation
        on a station, or that station rolls it back (issue "The closed loop").
        """
        try:  # the name and version become directories: check them before any copy
            validate.identifier(name, "model name")
            validate.positive(version, "model version")
            if latency_budget_ms is not None:
                validate.finite(latency_budget_ms, "latency budget (ms)", minimum=0.001)
        except ProtocolError as exc:
            raise RegistryError(str(exc)) from None
        if not source.is_file():
            raise RegistryError(f"{source} does not exist or is not a file")
        if model_store.exists(self.store, name, version):
            raise RegistryError(
                f"{name}:{version} is already published; versions are immutable, use a new one"
            )
        spec = read_spec(source)
        if classes is None:
            meta_classes = spec.metadata.get("classes", "")
            classes = tuple(c for c in meta_classes.split(",") if c)
        if not classes:
            raise RegistryError(
                "the model's class names are unknown: pass --classes (e.g. clean,scratch) "
                "or set ONNX metadata 'classes'"
            )
        problem = class_count_problem(spec.outputs, classes)
        if problem is not None:
            raise RegistryError(f"cannot publish {name}:{version}: {problem}")
        for class_name in sorted(thresholds.class_thresholds if thresholds else {}):
            refusal = unknown_class(class_name, classes, f"a class of {name}:{version}")
            if refusal is not None:
                raise RegistryError(f"cannot publish {name}:{version}: threshold for {refusal}")
        if positive_classes is None:
            meta_positive = spec.metadata.get("positive_classes", "")
            positive_classes = tuple(c for c in meta_positive.split(",") if c)
        latest = self.latest_version(name)
        if lineage is None:
            lineage = Lineage(parent_version=latest)
        elif lineage.parent_version is None and latest is not None:
            lineage = Lineage(latest, lineage.run_id, lineage.data, lineage.note)
        if trainable is not None and not trainable.weights.is_file():
            raise RegistryError(f"weights file {trainable.weights} does not exist")
        dest = self.artifacts / name / str(version) / "model.onnx"
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".tmp")
        shutil.copyfile(source, tmp)
        tmp.replace(dest)
        trainable_spec = None
        if trainable is not None:
            weights = dest.with_name(WEIGHTS_FILE)
            shutil.copyfile(trainable.weights, weights.with_suffix(".tmp"))
            weights.with_suffix(".tmp").replace(weights)
        try:
            if trainable is not None:
                trainable_spec = Trainable(
                    family=trainable.family,
                    params=dict(trainable.params),
                    weights_sha256=sha256_file(weights),
                    weights_size=weights.stat().st_size,
                )
            manifest = ModelManifest(
                name=name,
                version=version,
                sha256=sha256_file(dest),
                size=dest.stat().st_size,
                inputs=spec.inputs,
                outputs=spec.outputs,
                classes=classes,
                positive_classes=positive_classes,
                created_at=time.time(),
                lineage=lineage,
                preprocess=preprocess,
                trainable=trainable_spec,
                thresholds=thresholds,
                latency_budget_ms=latency_budget_ms,
            )
        except ProtocolError as exc:
            raise RegistryError(f"cannot publish {name}:{version}: {exc}") from None
        envelope = self.key.sign(manifest)
        model_store.add(
            self.store,
            name=name,
            version=version,
            sha256=manifest.sha256,
            size=manifest.size,
            manifest=codec.encode(manifest).decode(),
            envelope=envelope.decode(),
            path=str(dest),
            parent_version=lineage.parent_version,
            run_id=lineage.run_id,
            created_at=manifest.created_at,
        )
        return PublishedModel(manifest, envelope, dest)

    def latest_version(self, name: str) -> int | None:
        return model_store.latest_version(self.store, name)

    def get(self, name: str, version: int) -> PublishedModel:
        row = model_store.get(self.store, name, version)
        if row is None:
            raise UnknownModelError(
                f"model {name}:{version} is not in the registry; see `fedge model list`"
            )
        manifest = codec.decode(row.manifest.encode(), ModelManifest)
        return PublishedModel(manifest, row.envelope.encode(), Path(row.path))

    def list(self) -> list[ListedModel]:
        """Every published version, by name then version."""
        return [
            ListedModel(
                name=row.name,
                version=row.version,
                sha256=row.sha256,
                size=row.size,
                classes=tuple(json.loads(row.manifest)["classes"]),
                parent_version=row.parent_version,
                run_id=row.run_id,
                created_at=row.created_at,
            )
            for row in model_store.rows(self.store)
        ]

    # -- the gRPC ArtifactSource protocol

    def manifest_envelope(self, name: str, version: int) -> bytes:
        try:
            return self.get(name, version).envelope
        except UnknownModelError as exc:
            raise LookupError(str(exc)) from None

    def artifact_path(self, name: str, version: int) -> Path:
        try:
            return self.get(name, version).path
        except UnknownModelError as exc:
            raise LookupError(str(exc)) from None

    def artifact_sha256(self, name: str, version: int) -> str:
        try:
            return self.get(name, version).manifest.sha256
        except UnknownModelError as exc:
            raise LookupError(str(exc)) from None

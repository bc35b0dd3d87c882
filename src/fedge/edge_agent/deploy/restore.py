"""Which model serves after a start: the active one if it still verifies, else a fallback.

The deployer keeps every model it verified (``models/<name>/<version>/model.onnx``). The
agent remembers, newest first, the signed manifest and the deployment of the last
:data:`KEEP` models it made active (:class:`KeptModel`). At start-up each candidate is
checked as a deployment checks a download -- the manifest's signature, the file's sha256
against it, a load and a smoke inference -- the active model first, then the kept ones.

When the active model fails (one flipped byte on disk was enough: issue "A
fault-injection and soak suite", defect 2), the newest kept model that verifies serves
instead, the manager gets a ``failed`` deploy status whose reason starts with
``restore_failed`` and whose ``serving`` names the fallback, and the deployment becomes
due again: the desired document is retained on the broker, so lowering the agent's
``deploy_done_version`` below it makes the agent fetch it again when it connects.

Pure apart from :func:`verify` (files, ONNX Runtime): the agent reads and writes the
pointers in its store and passes :func:`verify` in.
"""

import json
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from fedge.edge_agent.deploy import deployer
from fedge.edge_agent.errors import DeployError
from fedge.edge_agent.inference import runtime
from fedge.protocols import codec
from fedge.protocols.deployment import DeploymentDesired, DeployStage, DeployStatus
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import ModelManifest
from fedge.protocols.signing import KeyRing, TrustedKeys, signer_of, unverified_payload

# Models remembered for a fallback, the active one included.
KEEP = 3

T = TypeVar("T")


@dataclass(frozen=True)
class KeptModel:
    """A model the agent verified and made active, and the deployment that brought it."""

    path: Path
    name: str
    version: int
    # The registry's signed manifest, verbatim. Pointers written before it was kept have
    # "" here and the manifest the agent verified at the time in ``manifest`` (encoded).
    manifest_envelope: str = ""
    manifest: str = ""
    deployment_id: str = ""
    deployment_version: int = 0
    # The anomaly model served beside it (issue 28; "": none): its file and signed
    # manifest, re-verified with it at every start and by a rollback to it.
    anomaly_path: str = ""
    anomaly_envelope: str = ""

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def anomaly_ref(self) -> str:
        """``name:version`` of the anomaly model beside it ("": none, or unreadable --
        :func:`verify` says what is wrong with it)."""
        if not self.anomaly_envelope:
            return ""
        try:
            return unverified_payload(self.anomaly_envelope.encode(), ModelManifest).ref
        except ProtocolError:
            return ""

    @property
    def files(self) -> tuple[Path, str]:
        """What tells kept pairs apart: one classifier may be kept beside two anomaly
        models (a deployment that changed only the anomaly model, issue 28)."""
        return self.path, self.anomaly_path

    def verified_manifest(self, keys: TrustedKeys) -> ModelManifest:
        if self.manifest_envelope:
            return _kept_manifest(self.manifest_envelope, keys)
        try:
            return codec.decode(self.manifest.encode(), ModelManifest)
        except ProtocolError as exc:
            raise DeployError("bad_pointer", f"stored manifest of {self.ref}: {exc}") from None


def _kept_manifest(text: str, keys: TrustedKeys) -> ModelManifest:
    envelope = text.encode()
    if isinstance(keys, KeyRing) and _signer(envelope) in keys.retired:
        # Verified by this agent when it was kept, under a key the manager has
        # since rotated away from: the station's own record still stands.
        return deployer.unverified_manifest(envelope)
    return deployer.open_manifest(envelope, keys)


def _signer(envelope: bytes) -> str:
    try:
        return signer_of(envelope)
    except ProtocolError:
        return ""  # open_manifest says what is wrong with it


def kept_from(desired: DeploymentDesired, model: runtime.LoadedModel) -> KeptModel:
    """What to remember of a model a deployment just made active."""
    return KeptModel(
        path=model.path,
        name=model.manifest.name,
        version=model.manifest.version,
        manifest_envelope=desired.manifest_envelope,
        manifest=codec.encode(model.manifest).decode(),
        deployment_id=desired.deployment_id,
        deployment_version=desired.version,
        anomaly_path="" if model.anomaly is None else str(model.anomaly.path),
        anomaly_envelope=desired.anomaly_envelope or "",
    )


# -- the pointers in the agent's store (JSON)


def _plain(kept: KeptModel) -> dict[str, Any]:
    # "manifest" and "path" are the keys of the original pointer: an older agent started
    # on this store still restores its active model.
    plain: dict[str, Any] = {
        "path": str(kept.path),
        "manifest": kept.manifest,
        "manifest_envelope": kept.manifest_envelope,
        "name": kept.name,
        "version": kept.version,
        "deployment_id": kept.deployment_id,
        "deployment_version": kept.deployment_version,
    }
    if kept.anomaly_path:  # only then: a pointer without one reads as before
        plain["anomaly_path"] = kept.anomaly_path
        plain["anomaly_envelope"] = kept.anomaly_envelope
    return plain


def _from_plain(data: Any) -> KeptModel:
    if not isinstance(data, dict) or not isinstance(data.get("path"), str):
        raise DeployError("bad_pointer", f"not a model pointer: {str(data)[:200]!r}")
    manifest = str(data.get("manifest", ""))
    name, version = data.get("name"), data.get("version")
    try:
        if not isinstance(name, str) or not isinstance(version, int):
            # An original pointer: the name and version are in the manifest it carries.
            decoded = codec.decode(manifest.encode(), ModelManifest)
            name, version = decoded.name, decoded.version
        return KeptModel(
            path=Path(data["path"]),
            name=name,
            version=version,
            manifest_envelope=str(data.get("manifest_envelope", "")),
            manifest=manifest,
            deployment_id=str(data.get("deployment_id", "")),
            deployment_version=int(data.get("deployment_version", 0)),
            anomaly_path=str(data.get("anomaly_path", "")),
            anomaly_envelope=str(data.get("anomaly_envelope", "")),
        )
    except (ProtocolError, TypeError, ValueError) as exc:
        raise DeployError("bad_pointer", f"unreadable model pointer: {exc}") from None


def encode_kept(kept: KeptModel) -> str:
    return json.dumps(_plain(kept), separators=(",", ":"))


def decode_kept(raw: str) -> KeptModel:
    """The active-model pointer; :class:`DeployError` ``bad_pointer`` if it is unreadable."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise DeployError("bad_pointer", f"active model pointer is not JSON: {exc}") from None
    return _from_plain(data)


def encode_history(history: Iterable[KeptModel]) -> str:
    return json.dumps([_plain(k) for k in history], separators=(",", ":"))


def decode_history(raw: str | None) -> tuple[KeptModel, ...]:
    """The kept models, newest first; unreadable entries are left out (they cannot serve)."""
    if raw is None:
        return ()
    try:
        data = json.loads(raw)
    except ValueError:
        return ()
    kept = []
    for item in data if isinstance(data, list) else []:
        try:
            kept.append(_from_plain(item))
        except DeployError:
            continue
    return tuple(kept)


# -- decisions


def remember(
    history: Iterable[KeptModel], kept: KeptModel, keep: int = KEEP
) -> tuple[KeptModel, ...]:
    """``kept`` first, then the others newest first (one entry per file pair), at most
    ``keep``."""
    others = tuple(k for k in history if k.files != kept.files)
    return (kept, *others)[:keep]


def candidates(active: KeptModel | None, history: Iterable[KeptModel]) -> tuple[KeptModel, ...]:
    """The order to try at start-up: the active model, then the kept ones newest first."""
    if active is None:
        return tuple(history)
    return (active, *(k for k in history if k.files != active.files))


def without(history: Iterable[KeptModel], kept: KeptModel) -> tuple[KeptModel, ...]:
    """``history`` less ``kept``'s files: a model rolled back is no fallback any more."""
    return tuple(k for k in history if k.files != kept.files)


def rollback_target(
    history: Iterable[KeptModel],
    previous: str,
    rolled_back: Iterable[str],
    previous_anomaly: str | None = None,
) -> KeptModel | None:
    """The kept model a failed trial goes back to: the one it replaced (``previous``,
    with ``previous_anomaly`` beside it: "" none; None: a trial stored before pairs were
    judged, any), never another -- the newest kept model may be one the manager moved
    this station away from -- and never one brought by a deployment rolled back here."""
    refused = set(rolled_back)
    for kept in history:
        if (
            kept.ref == previous
            and previous_anomaly in (None, kept.anomaly_ref)
            and kept.deployment_id not in refused
        ):
            return kept
    return None


# Rolled-back deployments remembered (the newest): enough for every retained document.
KEEP_ROLLED_BACK = 16


def decode_rolled_back(raw: str | None) -> dict[str, str]:
    """The deployments rolled back on this station (id -> reason), oldest first."""
    try:
        data = json.loads(raw or "{}")
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def encode_rolled_back(rolled_back: dict[str, str]) -> str:
    return json.dumps(rolled_back, separators=(",", ":"))


def add_rolled_back(
    rolled_back: dict[str, str], deployment_id: str, reason: str, keep: int = KEEP_ROLLED_BACK
) -> dict[str, str]:
    """``rolled_back`` with ``deployment_id`` added as the newest, at most ``keep``."""
    entries = [(k, v) for k, v in rolled_back.items() if k != deployment_id]
    entries.append((deployment_id, reason[:500]))
    return dict(entries[-keep:])


@dataclass(frozen=True)
class Restored(Generic[T]):
    """What serves after a start (``model`` from ``kept``), and what failed on the way."""

    model: T | None
    kept: KeptModel | None
    failures: tuple[tuple[KeptModel, DeployError], ...]


def restore(order: Iterable[KeptModel], verify: Callable[[KeptModel], T]) -> Restored[T]:
    """The first model of ``order`` that passes ``verify`` (which raises DeployError)."""
    failures: list[tuple[KeptModel, DeployError]] = []
    for kept in order:
        try:
            return Restored(verify(kept), kept, tuple(failures))
        except DeployError as exc:
            failures.append((kept, exc))
    return Restored(None, None, tuple(failures))


def redeploy_floor(done: int, deployment_version: int) -> int:
    """The ``deploy_done_version`` that makes deployment ``deployment_version`` due again.

    0 (every retained deployment is due) when the version is not known.
    """
    if deployment_version <= 0:
        return 0
    return max(0, min(done, deployment_version - 1))


def restore_status(
    edge: str,
    active: KeptModel | None,
    previous: DeployStatus | None,
    error: DeployError,
    serving: str,
    now: float,
) -> DeployStatus | None:
    """The deploy status that tells the manager the active model failed its restore.

    It names the deployment that brought the model (else the one last reported) and the
    model serving now; None when no deployment is known to report against.
    """
    if active is not None:
        model_name, model_version = active.name, active.version
    elif previous is not None:
        model_name, model_version = previous.model_name, previous.model_version
    else:
        return None
    deployment_id = active.deployment_id if active is not None else ""
    version = active.deployment_version if active is not None else 0
    if not deployment_id and previous is not None:
        deployment_id, version = previous.deployment_id, previous.version
    if not deployment_id:
        return None
    fallback = (
        f"serving {serving}, the newest previous model that verifies"
        if serving
        else "no previous model verifies, serving none"
    )
    reason = f"restore_failed: {error}; {fallback}; fetching the deployment again"
    return DeployStatus(
        edge,
        deployment_id,
        version,
        model_name,
        model_version,
        DeployStage.FAILED,
        reason[:1000],
        serving,
        now,
    )


# -- the adapter


def verify(
    kept: KeptModel,
    keys: TrustedKeys,
    preferred: Sequence[str] = runtime.DEFAULT_PROVIDERS,
) -> runtime.LoadedModel:
    """Check a kept model as a deployment checks a download; return it ready to serve
    (with the ``preferred`` execution providers this machine offers)."""
    manifest = kept.verified_manifest(keys)
    if (manifest.name, manifest.version) != (kept.name, kept.version):
        raise DeployError("manifest_mismatch", f"{kept.path} is {manifest.ref}, not {kept.ref}")
    try:
        digest = deployer._sha256(kept.path)
    except OSError as exc:
        raise DeployError("unreadable", f"{kept.ref} at {kept.path}: {exc}") from None
    if digest != manifest.sha256:
        raise DeployError(
            "hash_mismatch",
            f"{kept.ref} at {kept.path} changed on disk since it was verified "
            f"(sha256 {digest[:12]}… != manifest {manifest.sha256[:12]}…)",
        )
    model = runtime.load(kept.path, manifest, preferred)
    runtime.smoke_test(model)
    if not kept.anomaly_path:
        return model
    # The pair serves together or not at all: an anomaly model that no longer verifies
    # fails the kept pair, and the next candidate is tried.
    anomaly_manifest = _kept_manifest(kept.anomaly_envelope, keys)
    anomaly_path = Path(kept.anomaly_path)
    _check_file(anomaly_path, anomaly_manifest.sha256, anomaly_manifest.ref)
    anomaly = runtime.load(anomaly_path, anomaly_manifest, preferred)
    runtime.check_anomaly(model, anomaly)
    return model.with_anomaly(anomaly)


def _check_file(path: Path, sha256: str, ref: str) -> None:
    try:
        digest = deployer._sha256(path)
    except OSError as exc:
        raise DeployError("unreadable", f"{ref} at {path}: {exc}") from None
    if digest != sha256:
        raise DeployError(
            "hash_mismatch",
            f"{ref} at {path} changed on disk since it was verified "
            f"(sha256 {digest[:12]}… != manifest {sha256[:12]}…)",
        )


def prune_models(models_root: Path, kept: Iterable[KeptModel]) -> list[Path]:
    """Delete the model directories under ``models_root`` no kept model lives in.

    The layout is ``<models_root>/<name>/<version>/model.onnx``: a deployment's download
    directory, which holds the file once it verified. Kept models (the active one and
    the :data:`KEEP` before it) stay as fallbacks; everything else -- older models,
    partial downloads of failed deployments -- would otherwise fill the station's disk
    (issue "A fault-injection and soak suite", defect 8). Call it with no deployment under
    way. Returns the directories removed.
    """
    kept = list(kept)
    keep = {k.path.parent.resolve() for k in kept}
    keep |= {Path(k.anomaly_path).parent.resolve() for k in kept if k.anomaly_path}
    removed: list[Path] = []
    if not models_root.is_dir():
        return removed
    for name_dir in sorted(p for p in models_root.iterdir() if p.is_dir()):
        for version_dir in sorted(p for p in name_dir.iterdir() if p.is_dir()):
            if version_dir.resolve() in keep:
                continue
            shutil.rmtree(version_dir, ignore_errors=True)
            removed.append(version_dir)
        if not any(name_dir.iterdir()):
            name_dir.rmdir()
    return removed

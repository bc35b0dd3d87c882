"""Model deployment on the edge: download, verify, stage, smoke-test, swap.

Every step that can fail raises :class:`DeployError` with a short reason tag; the caller
reports it and keeps serving the previous model. Order matters: the manifest's signature
is checked before a byte is downloaded, the artifact's size and sha256 before it is
loaded, and a smoke inference before it takes traffic.
"""

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from fedge.edge_agent.errors import DeployError
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.settings import AgentSettings
from fedge.protocols.deployment import DeploymentDesired, DeployStage
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import ModelManifest
from fedge.protocols.signing import TrustedKeys, open_signed, unverified_payload
from fedge.transport.grpc.client import DownloadError, download_artifact

log = logging.getLogger(__name__)

StageCallback = Callable[[DeployStage, str], None]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def open_manifest(envelope: bytes, keys: TrustedKeys) -> ModelManifest:
    try:
        return open_signed(envelope, ModelManifest, keys)
    except ProtocolError as exc:
        raise DeployError(exc.reason, f"model manifest: {exc}") from None


def unverified_manifest(envelope: bytes) -> ModelManifest:
    """A manifest this agent verified before (see restore.KeptModel)."""
    try:
        return unverified_payload(envelope, ModelManifest)
    except ProtocolError as exc:
        raise DeployError(exc.reason, f"model manifest: {exc}") from None


def prepare(
    desired: DeploymentDesired,
    settings: AgentSettings,
    keys: TrustedKeys,
    on_stage: StageCallback,
    *,
    attempts: int = 5,
    backoff_s: float = 0.5,
) -> runtime.LoadedModel:
    """Everything up to (not including) the swap; returns the model ready to serve.

    A deployment that names an anomaly model (issue 28) gets it the same way -- its
    manifest's signature checked before a byte is downloaded, its size and sha256 before
    it loads, a smoke inference -- and it must take the classifier's images as they are;
    either failing fails the deployment, and the pair serves together or not at all.
    """
    manifest = open_manifest(desired.manifest_envelope.encode(), keys)
    anomaly_manifest = (
        None
        if desired.anomaly_envelope is None
        else open_manifest(desired.anomaly_envelope.encode(), keys)
    )
    target = desired.grpc_target or settings.grpc_target
    final = fetch(manifest, target, settings, keys, on_stage, attempts, backoff_s)
    model = runtime.load(final, manifest, settings.execution_providers)
    runtime.smoke_test(model)
    if anomaly_manifest is not None:
        path = fetch(anomaly_manifest, target, settings, keys, on_stage, attempts, backoff_s)
        anomaly = runtime.load(path, anomaly_manifest, settings.execution_providers)
        runtime.check_anomaly(model, anomaly)
        model = model.with_anomaly(anomaly)
    on_stage(DeployStage.STAGED, "")
    return model


def fetch(
    manifest: ModelManifest,
    target: str,
    settings: AgentSettings,
    keys: TrustedKeys,
    on_stage: StageCallback,
    attempts: int = 5,
    backoff_s: float = 0.5,
) -> Path:
    """``manifest``'s artifact on disk, downloaded and verified unless it is there."""
    models_dir = settings.data_dir / "models" / manifest.name / str(manifest.version)
    final = models_dir / "model.onnx"
    if final.exists() and _sha256(final) == manifest.sha256:
        on_stage(DeployStage.VERIFYING, "already on disk")
        return final
    on_stage(DeployStage.DOWNLOADING, "")
    download = models_dir / "model.onnx.download"
    models_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        try:
            result = download_artifact(
                target,
                settings.edge,
                settings.password,
                manifest.name,
                manifest.version,
                download,
                tls=settings.tls(),
            )
            break
        except DownloadError as exc:
            if attempt == attempts or exc.code in ("NOT_FOUND", "UNAUTHENTICATED"):
                raise DeployError("download_failed", str(exc)) from None
            log.warning("download of %s failed (attempt %d): %s", manifest.ref, attempt, exc)
            time.sleep(backoff_s * 2 ** (attempt - 1))
    on_stage(DeployStage.VERIFYING, "")
    served = open_manifest(result.manifest_envelope, keys)
    if served != manifest:
        download.unlink(missing_ok=True)
        raise DeployError(
            "manifest_mismatch", "the server's manifest differs from the deployment's"
        )
    size = download.stat().st_size
    if size != manifest.size:
        download.unlink(missing_ok=True)
        raise DeployError(
            "size_mismatch", f"artifact is {size} bytes, manifest says {manifest.size}"
        )
    digest = _sha256(download)
    if digest != manifest.sha256:
        download.unlink(missing_ok=True)
        raise DeployError(
            "hash_mismatch",
            f"artifact sha256 {digest[:12]}… != manifest {manifest.sha256[:12]}…",
        )
    download.replace(final)
    return final

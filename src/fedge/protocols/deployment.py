"""Deployments: the model an edge should run (desired) and how far it got (status)."""

from dataclasses import dataclass, field
from enum import StrEnum

from fedge.protocols import validate


@dataclass(frozen=True)
class DeploymentDesired:
    """Retained per edge. ``manifest_envelope`` is the registry's signed manifest, verbatim.

    The document is signed as a whole by the manager, and the manifest inside carries the
    registry's own signature, so an edge checks both before downloading a byte.
    """

    fleet: str
    edge: str
    version: int
    deployment_id: str
    manifest_envelope: str
    grpc_target: str = ""
    issued_at: float = 0.0
    # The registry's signed manifest of an anomaly model served beside the classifier
    # (issue 28): downloaded, verified and smoke-tested with it, swapped in with it, and
    # rolled back with it. Left out while unset, so an agent of before decodes the rest.
    anomaly_envelope: str | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        validate.identifier(self.edge, "edge")
        validate.positive(self.version, "version")
        validate.identifier(self.deployment_id, "deployment_id")
        validate.bounded_text(self.manifest_envelope, "manifest_envelope", 64 * 1024)
        validate.bounded_text(self.grpc_target, "grpc_target", 256)
        if self.anomaly_envelope is not None:
            validate.bounded_text(self.anomaly_envelope, "anomaly_envelope", 64 * 1024)


class DeployStage(StrEnum):
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    STAGED = "staged"
    ACTIVE = "active"
    FAILED = "failed"
    # The agent's own rollback: the model failed its health checks after activation and
    # the previous verified model serves again (``reason`` says which check).
    ROLLED_BACK = "rolled_back"
    # The model passed its probation after activation (``reason`` says over how many
    # images): a verdict on an active deployment, not a new stage of it. A manager of
    # before this value rejects the status (unknown stage) and keeps the edge ``active``.
    PASSED = "passed"


@dataclass(frozen=True)
class DeployStatus:
    edge: str
    deployment_id: str
    version: int
    model_name: str
    model_version: int
    stage: DeployStage
    reason: str = ""
    # The model still serving, whatever happened to this deployment (e.g. "inspect:2").
    serving: str = ""
    reported_at: float = 0.0

    def __post_init__(self) -> None:
        validate.identifier(self.edge, "edge")
        validate.identifier(self.deployment_id, "deployment_id")
        validate.u64(self.version, "version")
        validate.identifier(self.model_name, "model_name")
        validate.u64(self.model_version, "model_version")
        validate.bounded_text(self.reason, "reason", 1024)

"""One station's status as ``fedge agent status`` shows it (issue 27, item 7).

Pure: built either from the running agent's ``/v1/status`` reply (what it serves and the
thresholds it decides with, as held in memory) or, when it is not running, from its
file's :class:`~fedge.edge_agent.store.StoreFacts` -- the thresholds then computed with the
agent's own :func:`~fedge.edge_agent.config.decisions.thresholds_in_force` from the config
and model pointer it recorded, so both say the same for the same state.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from fedge.edge_agent.config.decisions import thresholds_in_force
from fedge.edge_agent.deploy import deployer
from fedge.edge_agent.deploy.restore import KeptModel, decode_kept
from fedge.edge_agent.errors import AgentError, DeployError
from fedge.edge_agent.store import StoreFacts
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import ModelManifest


@dataclass(frozen=True)
class Counts:
    """What the station's file holds: predictions and labels still indexed (retention
    prunes them), records not yet acknowledged, and when the far side last acknowledged
    one (its last contact that survives a restart)."""

    predictions: int
    rejects: int
    labels: int
    pending_records: int
    outbox_batches: int
    oldest_unsent_at: float | None
    last_acknowledged_at: float | None
    deployment: str  # the deployment that brought the active model ('' : none recorded)


@dataclass(frozen=True)
class StationStatus:
    edge: str
    running: bool  # read from the running agent (else from its file alone)
    source: str  # where it was read, and why there
    serving: str  # "name:version" ('' : none)
    config_version: int  # the config in force (0: none applied yet)
    thresholds: Mapping[str, Any]  # ThresholdsInForce.describe()
    counts: Counts
    broker_connected: bool | None  # None: unknown (the agent is not running)
    via_grpc: bool | None
    execution_provider: str | None

    def to_plain(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def reject_rate(self) -> float | None:
        held = self.counts.predictions
        return self.counts.rejects / held if held else None


def counts_of(facts: StoreFacts) -> Counts:
    return Counts(
        predictions=facts.predictions,
        rejects=facts.rejects,
        labels=facts.labels,
        pending_records=facts.pending_records,
        outbox_batches=facts.outbox_batches,
        oldest_unsent_at=facts.oldest_unsent_at,
        last_acknowledged_at=facts.last_acknowledged_at,
        deployment=_deployment(_kept(facts.active_model)),
    )


def from_facts(edge: str, facts: StoreFacts, source: str) -> StationStatus:
    """The status of a station that is not running, from its file: the model its pointer
    names and the thresholds that config and model give (what it will decide with when
    it starts, unless the model no longer verifies and a kept one serves instead)."""
    kept = _kept(facts.active_model)
    manifest = _manifest(kept)
    config = _config(facts.applied_config)
    in_force = thresholds_in_force(config, manifest)
    return StationStatus(
        edge=edge,
        running=False,
        source=source,
        serving="" if kept is None else kept.ref,
        config_version=0 if config is None else config.version,
        thresholds=in_force.describe(),
        counts=counts_of(facts),
        broker_connected=None,
        via_grpc=None,
        execution_provider=None,
    )


def from_api(reply: Mapping[str, Any], counts: Counts, source: str) -> StationStatus:
    """The status of a running agent from its ``/v1/status`` reply (``counts``: the
    reply's own, or its file's for an agent older than them)."""
    try:
        return StationStatus(
            edge=str(reply["edge"]),
            running=True,
            source=source,
            serving=str(reply.get("serving") or ""),
            config_version=int(reply.get("config_version") or 0),
            thresholds=dict(reply["thresholds"]),
            counts=counts,
            broker_connected=bool(reply.get("connected")),
            via_grpc=bool(reply.get("desired_via_grpc")),
            execution_provider=reply.get("execution_provider"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise AgentError(
            f"the agent's status reply lacks {exc}: is it an older fedge? upgrade the agent"
        ) from None


def counts_from_reply(plain: Mapping[str, Any]) -> Counts:
    """:class:`Counts` as the local API sends them (``/v1/status``'s ``"counts"``)."""
    try:
        return Counts(**plain)
    except TypeError as exc:
        raise AgentError(f"the agent's status counts are unreadable ({exc})") from None


def threshold_text(thresholds: Mapping[str, Any]) -> str:
    """The thresholds in force as one line: the default, each class with its own (which
    overrides the default for that class), and where they come from."""
    shown = f"{float(thresholds.get('default_threshold', 0.5)):g}"
    own = dict(thresholds.get("class_thresholds") or {})
    if own:
        listed = ", ".join(f"{c} {float(t):g}" for c, t in sorted(own.items()))
        shown = f"default {shown}; per-class (overrides the default): {listed}"
    source = str(thresholds.get("source", ""))
    tied = thresholds.get("tied_to")
    origin = {
        "config": "the config",
        "model": "the serving model's recommendation",
        "untied": f"the config, set for {tied or 'another model'}",
        "default": "the agent's default (no config, no recommendation)",
    }.get(source, source)
    return f"{shown} (from {origin})"


def _kept(pointer: str | None) -> KeptModel | None:
    if pointer is None:
        return None
    try:
        return decode_kept(pointer)
    except DeployError:
        return None  # unreadable: the agent restores a kept model at start (restore.py)


def _deployment(kept: KeptModel | None) -> str:
    if kept is None or not kept.deployment_id:
        return ""
    return f"{kept.deployment_id} (v{kept.deployment_version})"


def _manifest(kept: KeptModel | None) -> ModelManifest | None:
    if kept is None:
        return None
    try:
        if kept.manifest_envelope:
            # Verified by the agent when it kept it; shown here, never served from here.
            return deployer.unverified_manifest(kept.manifest_envelope.encode())
        return codec.decode(kept.manifest.encode(), ModelManifest)
    except (DeployError, ProtocolError):
        return None


def _config(raw: str | None) -> EdgeConfig | None:
    if raw is None:
        return None
    try:
        return codec.decode(raw.encode(), EdgeConfig)
    except ProtocolError:
        return None

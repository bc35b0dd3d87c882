"""A staged rollout loaded from the store, and the writes that carry a step out.

The store side of rollouts.py (split out of it): :func:`load` reads a rollout into the
pure state machine's values (rollout.py), :func:`write_step` writes a
:class:`~fedge.edge_manager.rollout.machine.Step` -- the edges' deployments and configs through
:class:`Fleet` (passing the rollout's id, which the rollout guard lets through), the
rollout's state, reason and events -- inside the caller's transaction. The statements
are rollout_store.py's.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.registry.recommendations import recommended_anomaly_threshold
from fedge.edge_manager.registry.versions import parse_ref
from fedge.edge_manager.rollout import machine
from fedge.edge_manager.rollout import store as rollout_store
from fedge.edge_manager.rollout import thresholds as rollout_configs
from fedge.edge_manager.rollout.machine import EdgeState, EventKind, RolloutState
from fedge.edge_manager.rollout.plan import RolloutError, RolloutPlan
from fedge.edge_manager.rollout.store import record_event
from fedge.edge_manager.store import Store, Transaction
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import ModelManifest, Thresholds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    rollout: machine.Rollout
    rows: dict[str, rollout_store.RolloutEdgeRow]  # by edge


def recommended_thresholds(conn: Transaction, manifest: ModelManifest) -> Thresholds | None:
    """The gate evidence's ``recommended_thresholds``, else the manifest's (else None)."""
    evidence = rollout_store.gate_evidence(conn, manifest.name, manifest.version)
    if evidence is not None:
        try:
            found = json.loads(evidence).get("recommended_thresholds")
            if isinstance(found, dict):
                return Thresholds(
                    default_threshold=float(found["default_threshold"]),
                    class_thresholds={
                        str(k): float(v) for k, v in dict(found.get("class_thresholds", {})).items()
                    },
                )
        except (ValueError, TypeError, KeyError, AttributeError, ProtocolError) as exc:
            log.warning(
                "%s: unusable recommended thresholds in gate evidence: %s", manifest.ref, exc
            )
    return manifest.thresholds


def previous_model(fleet: Fleet, edge: str) -> str | None:
    """What ``edge`` runs now, to go back to: the model it reports serving if the registry
    has it, else the model of its latest desired deployment."""
    serving = edge_store.serving(fleet.store.conn, edge)
    if serving:
        name, _, version = serving.rpartition(":")
        if version.isdigit() and rollout_store.is_published(fleet.store.conn, name, int(version)):
            return serving
    deployed = fleet.deployed_model(edge)
    return None if deployed is None else f"{deployed[0]}:{deployed[1]}"


def halt(store: Store, rollout_id: str, reason: str, now: float) -> int:
    """Record ``reason`` and pause the rollout (machine.halted) straight from its row, so a
    rollout whose plan or edges cannot even be loaded is stopped too. The same error
    again is not recorded again (a paused rollout is still stepped every second)."""
    with store.transaction() as conn:
        row = rollout_store.rollout_row(conn, rollout_id)
        if row is None or row.reason == reason:
            return 0
        result = machine.halted(RolloutState(row.state), int(row.wave), reason)
        rollout_store.set_halted(conn, rollout_id, result.state.value, reason, now)
        for event in result.events:
            record_event(conn, rollout_id, now, event.kind.value, event.edge, event.detail)
    return 1


def load(conn: Transaction, rollout_id: str) -> Loaded:
    head = rollout_store.rollout_row(conn, rollout_id)
    if head is None:
        raise RolloutError(f"no rollout {rollout_id!r}; see `fedge rollout list`")
    plan = head.plan
    aborted_at = rollout_store.last_event_at(conn, rollout_id, EventKind.ABORTED.value)
    rows = rollout_store.edge_rows(conn, rollout_id)
    edges = tuple(
        machine.RolloutEdge(edge, r.wave, EdgeState(r.state), r.moved_at)
        for edge, r in rows.items()
    )
    try:
        stored = json.loads(plan)
    except ValueError:
        raise RolloutError(f"rollout {rollout_id}: its stored plan is not JSON") from None
    if not isinstance(stored, dict):
        raise RolloutError(f"rollout {rollout_id}: a stored rollout plan is damaged: {plan!r}")
    rollout = machine.Rollout(
        rollout_id,
        f"{head.model_name}:{head.model_version}",
        RolloutPlan.from_json_dict(stored),
        RolloutState(head.state),
        int(head.wave),
        edges,
        reason=str(head.reason or ""),
        aborted_at=aborted_at,
    )
    return Loaded(rollout, rows)


def write_step(fleet: Fleet, loaded: Loaded, result: machine.Step, now: float) -> None:
    """Carry ``result`` out inside the caller's transaction."""
    conn = fleet.store.conn
    rollout = loaded.rollout
    for edge in result.move:
        _move(fleet, rollout, edge, now)
    for edge in result.roll_back:
        _send_back(fleet, loaded.rows[edge], now)
    for edge in result.back:
        rollout_store.set_edge_restored(
            conn, rollout.rollout_id, edge, EdgeState.ROLLED_BACK.value, now
        )
    for edge in result.unconfirmed:
        rollout_store.set_edge_state(conn, rollout.rollout_id, edge, EdgeState.UNCONFIRMED.value)
    rollout_store.set_stepped(
        conn,
        rollout.rollout_id,
        state=result.state.value,
        wave=result.wave,
        reason=result.reason,
        finished_at=now if result.finished else None,
        now=now,
    )
    for event in result.events:
        record_event(conn, rollout.rollout_id, now, event.kind.value, event.edge, event.detail)


def _anomaly_threshold(fleet: Fleet, anomaly: str | None, edge: str) -> float | None:
    """The station's own threshold for the anomaly model ``anomaly`` (None: none kept)."""
    if anomaly is None:
        return None
    try:
        return recommended_anomaly_threshold(fleet.registry.artifacts, *parse_ref(anomaly), edge)
    except ManagerError as exc:
        log.info("%s: no anomaly threshold of its own for %s (%s)", edge, anomaly, exc)
        return None


def _kept_anomaly(fleet: Fleet, classifier: ModelManifest, anomaly: str, edge: str) -> str | None:
    """The anomaly model ``edge`` serves, kept beside a classifier-only rollout's model
    where it can serve beside it (issue 28): the rollout changes the classifier, not the
    pair's other half, and its anomaly threshold (tied to that model) stays in force. One
    that cannot (other images, no longer published or signed) is dropped, and said so."""
    try:
        fleet.anomaly_companion(classifier, parse_ref(anomaly), images=True)
    except ManagerError as exc:
        log.warning(
            "%s: the anomaly model %s it serves does not go with %s (%s); it will serve "
            "the classifier alone",
            edge,
            anomaly,
            classifier.ref,
            exc,
        )
        return None
    return anomaly


def _move(fleet: Fleet, rollout: machine.Rollout, edge: str, now: float) -> None:
    name, version = parse_ref(rollout.model)
    before = previous_model(fleet, edge)
    # The anomaly model it serves beside that classifier: restored with it (issue 28).
    before_anomaly = fleet.deployed_anomaly(edge) if before is not None else None
    if before is not None and fleet.deployed_model(edge) != parse_ref(before):
        before_anomaly = None  # the latest deployment is not what it serves
    current = fleet.desired_config(edge)
    published = fleet.registry.get(name, version)
    anomaly = rollout.plan.anomaly
    beside = anomaly
    if anomaly is None and before_anomaly is not None:
        beside = _kept_anomaly(fleet, published.manifest, before_anomaly, edge)
    deployment_id = fleet.deploy(
        name,
        version,
        [edge],
        within_rollout=rollout.rollout_id,
        anomaly=None if beside is None else parse_ref(beside),
    )
    config = _config(
        lambda: rollout_configs.moved_config(
            current,
            fleet=fleet.fleet,
            edge=edge,
            model=rollout.model,
            recommended=recommended_thresholds(fleet.store.conn, published.manifest),
            now=now,
            anomaly=anomaly,
            anomaly_threshold=_anomaly_threshold(fleet, anomaly, edge),
        ),
        edge,
    )
    fleet.push_config(config, now, within_rollout=rollout.rollout_id)
    rollout_store.set_edge_moved(
        fleet.store.conn,
        rollout.rollout_id,
        edge,
        state=EdgeState.MOVED.value,
        previous_model=before,
        previous_anomaly=before_anomaly,
        previous_config=None if current is None else codec.encode(current).decode(),
        moved_at=now,
        deployment_id=deployment_id,
        config_version=config.version,
    )


def _send_back(fleet: Fleet, row: rollout_store.RolloutEdgeRow, now: float) -> None:
    edge, before, rollout_id = row.edge, row.previous_model, row.rollout_id
    deployment_id = None
    if before:
        name, version = parse_ref(before)
        # The previous pair: the classifier and the anomaly model beside it (or none).
        anomaly = None if row.previous_anomaly is None else parse_ref(row.previous_anomaly)
        deployment_id = fleet.deploy(
            name, version, [edge], within_rollout=rollout_id, anomaly=anomaly
        )
    previous = (
        None
        if row.previous_config is None
        else codec.decode(row.previous_config.encode(), EdgeConfig)
    )
    config = _config(
        lambda: rollout_configs.restored_config(
            fleet.desired_config(edge),
            previous,
            fleet=fleet.fleet,
            edge=edge,
            previous_model=before,
            now=now,
        ),
        edge,
    )
    fleet.push_config(config, now, within_rollout=rollout_id)
    rollout_store.set_edge_sent_back(
        fleet.store.conn,
        rollout_id,
        edge,
        state=EdgeState.ROLLING_BACK.value,
        deployment_id=deployment_id,
        config_version=config.version,
    )


def _config(build: Callable[[], EdgeConfig], edge: str) -> EdgeConfig:
    try:
        config = build()
    except ProtocolError as exc:
        raise ManagerError(f"the config for {edge} is not valid: {exc}") from None
    return config

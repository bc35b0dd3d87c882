"""A staged rollout's rows in the store, and the writes that carry a step out.

The store side of rollouts.py (split out of it): :func:`load` reads a rollout into the
pure state machine's values (rollout.py), :func:`write_step` writes a
:class:`~fedge.edge_manager.rollout.Step` -- the edges' deployments and configs through
:class:`Fleet` (passing the rollout's id, which the rollout guard lets through), the
rollout's state, reason and events -- inside the caller's transaction.
"""

import json
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager import rollout as machine
from fedge.edge_manager import rollout_configs
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import Fleet
from fedge.edge_manager.registry import parse_ref
from fedge.edge_manager.rollout import EdgeState, EventKind, RolloutState
from fedge.edge_manager.rollout_plan import RolloutError, RolloutPlan
from fedge.edge_manager.store import Store
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import ModelManifest, Thresholds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    rollout: machine.Rollout
    rows: dict[str, dict[str, Any]]  # rollout_edges rows by edge


def recommended_thresholds(conn: sqlite3.Connection, manifest: ModelManifest) -> Thresholds | None:
    """The gate evidence's ``recommended_thresholds``, else the manifest's (else None)."""
    row = conn.execute(
        "SELECT evidence FROM gate_results WHERE name=? AND version=? ORDER BY at DESC LIMIT 1",
        (manifest.name, manifest.version),
    ).fetchone()
    if row is not None:
        try:
            found = json.loads(row[0]).get("recommended_thresholds")
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
    serving = fleet.store.scalar("SELECT serving FROM edges WHERE edge=?", (edge,))
    if serving:
        name, _, version = str(serving).rpartition(":")
        if version.isdigit() and fleet.store.scalar(
            "SELECT 1 FROM models WHERE name=? AND version=?", (name, int(version))
        ):
            return str(serving)
    deployed = fleet.deployed_model(edge)
    return None if deployed is None else f"{deployed[0]}:{deployed[1]}"


def halt(store: Store, rollout_id: str, reason: str, now: float) -> int:
    """Record ``reason`` and pause the rollout (machine.halted) straight from its row, so a
    rollout whose plan or edges cannot even be loaded is stopped too. The same error
    again is not recorded again (a paused rollout is still stepped every second)."""
    with store.transaction() as conn:
        row = conn.execute(
            "SELECT state, wave, reason FROM rollouts WHERE rollout_id=?", (rollout_id,)
        ).fetchone()
        if row is None or row[2] == reason:
            return 0
        result = machine.halted(RolloutState(row[0]), int(row[1]), reason)
        conn.execute(
            "UPDATE rollouts SET state=?, reason=?, updated_at=? WHERE rollout_id=?",
            (result.state.value, reason, now, rollout_id),
        )
        for event in result.events:
            record_event(conn, rollout_id, now, event.kind.value, event.edge, event.detail)
    return 1


def load(conn: sqlite3.Connection, rollout_id: str) -> Loaded:
    head = conn.execute(
        "SELECT model_name, model_version, plan, state, wave, reason FROM rollouts "
        "WHERE rollout_id=?",
        (rollout_id,),
    ).fetchone()
    if head is None:
        raise RolloutError(f"no rollout {rollout_id!r}; see `fedge rollout list`")
    name, version, plan, state, wave, reason = head
    aborted_at = conn.execute(
        "SELECT max(at) FROM rollout_events WHERE rollout_id=? AND kind=?",
        (rollout_id, EventKind.ABORTED.value),
    ).fetchone()[0]
    cursor = conn.execute(
        "SELECT * FROM rollout_edges WHERE rollout_id=? ORDER BY wave, edge", (rollout_id,)
    )
    columns = [d[0] for d in cursor.description]
    rows = {str(r[1]): dict(zip(columns, r, strict=True)) for r in cursor.fetchall()}
    edges = tuple(
        machine.RolloutEdge(edge, int(r["wave"]), EdgeState(r["state"]), r["moved_at"])
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
        f"{name}:{version}",
        RolloutPlan.from_json_dict(stored),
        RolloutState(state),
        int(wave),
        edges,
        reason=str(reason or ""),
        aborted_at=None if aborted_at is None else float(aborted_at),
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
        conn.execute(
            "UPDATE rollout_edges SET state=?, restored_at=? WHERE rollout_id=? AND edge=?",
            (EdgeState.ROLLED_BACK.value, now, rollout.rollout_id, edge),
        )
    for edge in result.unconfirmed:
        conn.execute(
            "UPDATE rollout_edges SET state=? WHERE rollout_id=? AND edge=?",
            (EdgeState.UNCONFIRMED.value, rollout.rollout_id, edge),
        )
    reason = result.reason
    conn.execute(
        "UPDATE rollouts SET state=?, wave=?, updated_at=?, reason=coalesce(?, reason), "
        "finished_at=? WHERE rollout_id=?",
        (
            result.state.value,
            result.wave,
            now,
            reason,
            now if result.finished else None,
            rollout.rollout_id,
        ),
    )
    for event in result.events:
        record_event(conn, rollout.rollout_id, now, event.kind.value, event.edge, event.detail)


def _move(fleet: Fleet, rollout: machine.Rollout, edge: str, now: float) -> None:
    name, version = parse_ref(rollout.model)
    before = previous_model(fleet, edge)
    current = fleet.desired_config(edge)
    published = fleet.registry.get(name, version)
    deployment_id = fleet.deploy(name, version, [edge], within_rollout=rollout.rollout_id)
    config = _config(
        lambda: rollout_configs.moved_config(
            current,
            fleet=fleet.fleet,
            edge=edge,
            model=rollout.model,
            recommended=recommended_thresholds(fleet.store.conn, published.manifest),
            now=now,
        ),
        edge,
    )
    fleet.push_config(config, now, within_rollout=rollout.rollout_id)
    fleet.store.conn.execute(
        "UPDATE rollout_edges SET state=?, previous_model=?, previous_config=?, moved_at=?, "
        "deployment_id=?, config_version=? WHERE rollout_id=? AND edge=?",
        (
            EdgeState.MOVED.value,
            before,
            None if current is None else codec.encode(current).decode(),
            now,
            deployment_id,
            config.version,
            rollout.rollout_id,
            edge,
        ),
    )


def _send_back(fleet: Fleet, row: dict[str, Any], now: float) -> None:
    edge, before, rollout_id = str(row["edge"]), row["previous_model"], str(row["rollout_id"])
    deployment_id = None
    if before:
        name, version = parse_ref(str(before))
        deployment_id = fleet.deploy(name, version, [edge], within_rollout=rollout_id)
    previous = (
        None
        if row["previous_config"] is None
        else codec.decode(str(row["previous_config"]).encode(), EdgeConfig)
    )
    config = _config(
        lambda: rollout_configs.restored_config(
            fleet.desired_config(edge),
            previous,
            fleet=fleet.fleet,
            edge=edge,
            previous_model=None if before is None else str(before),
            now=now,
        ),
        edge,
    )
    fleet.push_config(config, now, within_rollout=rollout_id)
    fleet.store.conn.execute(
        "UPDATE rollout_edges SET state=?, restore_deployment_id=?, restore_config_version=? "
        "WHERE rollout_id=? AND edge=?",
        (EdgeState.ROLLING_BACK.value, deployment_id, config.version, row["rollout_id"], edge),
    )


def _config(build: Callable[[], EdgeConfig], edge: str) -> EdgeConfig:
    try:
        config = build()
    except ProtocolError as exc:
        raise ManagerError(f"the config for {edge} is not valid: {exc}") from None
    return config


def record_event(
    conn: sqlite3.Connection, rollout_id: str, at: float, kind: str, edge: str, detail: str
) -> None:
    conn.execute(
        "INSERT INTO rollout_events (rollout_id, at, kind, edge, detail) VALUES (?,?,?,?,?)",
        (rollout_id, at, kind, edge, detail),
    )

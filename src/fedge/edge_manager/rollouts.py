"""Staged rollouts in the manager's store: start, pause, resume, abort, and the driver.

The adapter around the pure state machine (rollout.py): it reads a rollout and what its
edges reported (rollout_health.py), calls :func:`rollout.step`, and writes the result --
the edges' deployments and configs through :class:`Fleet`, the rollout's new state and
its events -- in one transaction. Every bit of state is in the store, so a manager
killed mid-rollout resumes where it was; operators' commands (another process) take the
same write lock and apply the same pure transitions.

Moving an edge writes a deployment of the rollout's model and a config tied to it (the
gate's recommended thresholds, else the manifest's, else the edge's own). Rolling it back
writes a deployment of the model it served before and its thresholds from before, tied to
that model. A model must be blessed by the validation gate (its newest ``gate_results``
row) unless the operator forces it, which is recorded.
"""

import json
import logging
import sqlite3
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager import rollout as machine
from fedge.edge_manager import rollout_health as health
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import Fleet
from fedge.edge_manager.registry import parse_ref
from fedge.edge_manager.rollout import EdgeState, EventKind, RolloutState
from fedge.edge_manager.rollout_plan import RolloutError, RolloutPlan
from fedge.protocols import codec
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.manifest import ModelManifest, Thresholds

log = logging.getLogger(__name__)

# Created in the store, not by the machine (it never sees a rollout before it exists).
CREATED = "created"


@dataclass(frozen=True)
class Loaded:
    rollout: machine.Rollout
    rows: dict[str, dict[str, Any]]  # rollout_edges rows by edge


def blessed(conn: sqlite3.Connection, name: str, version: int) -> bool | None:
    """The gate's verdict: its newest row for the model (None: never gated)."""
    row = conn.execute(
        "SELECT blessed FROM gate_results WHERE name=? AND version=? ORDER BY at DESC LIMIT 1",
        (name, version),
    ).fetchone()
    return None if row is None else bool(row[0])


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


def active_rollouts_of(conn: sqlite3.Connection, edges: list[str]) -> dict[str, str]:
    """edge -> id of the unfinished rollout it belongs to, for ``edges``."""
    marks = ",".join("?" * len(edges))
    rows = conn.execute(
        f"SELECT e.edge, r.rollout_id FROM rollout_edges e JOIN rollouts r "
        f"ON r.rollout_id = e.rollout_id WHERE r.finished_at IS NULL AND e.edge IN ({marks})",
        tuple(edges),
    ).fetchall()
    return {str(edge): str(rid) for edge, rid in rows}


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


class Rollouts:
    """Operators' side: start, pause, resume, abort (the CLI and the console call these)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.store = fleet.store

    def start(
        self, model: str, plan: RolloutPlan, *, now: float, force_unblessed: bool = False
    ) -> str:
        """A new pending rollout (``serve`` moves its first wave); its id. Refused, with
        nothing written, for an unknown, damaged or unblessed model, an edge that could
        not be rolled back, or an edge already in an unfinished rollout."""
        name, version = parse_ref(model)
        published = self.fleet.registry.get(name, version)
        self.fleet.edges(list(plan.edges))
        published.verify()
        verdict = blessed(self.store.conn, name, version)
        if verdict is not True and not force_unblessed:
            why = "was never gated" if verdict is None else "was not blessed by the gate"
            raise RolloutError(
                f"{model} {why}; nothing was started. Run `fedge model gate {model}` and roll "
                "out a blessed model, or pass --force-unblessed to roll it out anyway (recorded)"
            )
        orphans = [e for e in plan.edges if previous_model(self.fleet, e) is None]
        if orphans:
            raise RolloutError(
                f"{', '.join(orphans)} run(s) no model yet, so a rollout could not roll them "
                "back; deploy a model to them first (`fedge deploy`) or leave them out; "
                "nothing was started"
            )
        rollout_id = f"r-{uuid.uuid4().hex[:10]}"
        edges = machine.initial_edges(plan)
        with self.store.transaction() as conn:
            busy = active_rollouts_of(conn, list(plan.edges))
            if busy:
                listed = ", ".join(f"{edge} ({rid})" for edge, rid in sorted(busy.items()))
                raise RolloutError(
                    f"edges already in an unfinished rollout: {listed}; wait for it to end or "
                    "`fedge rollout abort` it; nothing was started"
                )
            conn.execute(
                "INSERT INTO rollouts (rollout_id, model_name, model_version, plan, state, wave, "
                "forced_unblessed, reason, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    rollout_id,
                    name,
                    version,
                    json.dumps(plan.to_json_dict()),
                    RolloutState.PENDING.value,
                    -1,
                    int(force_unblessed and verdict is not True),
                    "",
                    now,
                    now,
                ),
            )
            conn.executemany(
                "INSERT INTO rollout_edges (rollout_id, edge, wave, state) VALUES (?,?,?,?)",
                [(rollout_id, e.edge, e.wave, e.state.value) for e in edges],
            )
            waves = ", ".join(f"{w * 100:g}%" for w in plan.waves)
            _event(
                conn,
                rollout_id,
                now,
                CREATED,
                "",
                f"{model} to {len(plan.edges)} edge(s); canary "
                f"{', '.join(plan.canary) or 'none'}; waves {waves}; health window "
                f"{plan.health_window_s:g}s; abort if "
                f"{', '.join(str(c) for c in plan.abort_if)}",
            )
            if force_unblessed and verdict is not True:
                _event(
                    conn,
                    rollout_id,
                    now,
                    EventKind.FORCED.value,
                    "",
                    f"{model} is not blessed; rolled out with --force-unblessed",
                )
        return rollout_id

    def pause(self, rollout_id: str, now: float) -> machine.Step:
        return self._operate(rollout_id, now, machine.pause)

    def resume(self, rollout_id: str, now: float) -> machine.Step:
        return self._operate(rollout_id, now, machine.resume)

    def abort(self, rollout_id: str, now: float, reason: str = "by operator") -> machine.Step:
        return self._operate(rollout_id, now, lambda r: machine.abort(r, reason))

    def _operate(
        self, rollout_id: str, now: float, decide: Callable[[machine.Rollout], machine.Step]
    ) -> machine.Step:
        with self.store.transaction() as conn:
            loaded = load(conn, rollout_id)
            result = decide(loaded.rollout)
            write_step(self.fleet, loaded, result, now)
        return result


class RolloutDriver:
    """The serve loop's side: one :meth:`tick` steps every unfinished rollout."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def tick(self, now: float) -> int:
        """Step every unfinished rollout (one transaction each); how many changed."""
        ids = [
            str(r["rollout_id"])
            for r in self.fleet.store.query(
                "SELECT rollout_id FROM rollouts WHERE finished_at IS NULL ORDER BY created_at"
            )
        ]
        changed = 0
        for rollout_id in ids:
            try:
                changed += self._tick_one(rollout_id, now)
            except ManagerError as exc:
                # A move that cannot be written (a damaged artifact, an unreachable
                # address): stop the rollout rather than retry it every second.
                log.error("rollout %s cannot go on: %s; aborting it", rollout_id, exc)
                with self.fleet.store.transaction() as conn:
                    loaded = load(conn, rollout_id)
                    if loaded.rollout.state in machine.MOVING | {RolloutState.PAUSED}:
                        write_step(self.fleet, loaded, machine.abort(loaded.rollout, str(exc)), now)
                changed += 1
        return changed

    def _tick_one(self, rollout_id: str, now: float) -> int:
        with self.fleet.store.transaction() as conn:
            loaded = load(conn, rollout_id)
            observed = health.rollout_health(conn, loaded.rollout, loaded.rows)
            result = machine.step(loaded.rollout, observed, now)
            if not result.changes and result.state is loaded.rollout.state:
                return 0
            write_step(self.fleet, loaded, result, now)
        return 1


def load(conn: sqlite3.Connection, rollout_id: str) -> Loaded:
    head = conn.execute(
        "SELECT model_name, model_version, plan, state, wave FROM rollouts WHERE rollout_id=?",
        (rollout_id,),
    ).fetchone()
    if head is None:
        raise RolloutError(f"no rollout {rollout_id!r}; see `fedge rollout list`")
    name, version, plan, state, wave = head
    cursor = conn.execute(
        "SELECT * FROM rollout_edges WHERE rollout_id=? ORDER BY wave, edge", (rollout_id,)
    )
    columns = [d[0] for d in cursor.description]
    rows = {str(r[1]): dict(zip(columns, r, strict=True)) for r in cursor.fetchall()}
    edges = tuple(
        machine.RolloutEdge(edge, int(r["wave"]), EdgeState(r["state"]), r["moved_at"])
        for edge, r in rows.items()
    )
    rollout = machine.Rollout(
        rollout_id,
        f"{name}:{version}",
        RolloutPlan.from_json_dict(json.loads(plan)),
        RolloutState(state),
        int(wave),
        edges,
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
    reason = next((e.detail for e in result.events if e.kind is EventKind.ABORTED), None)
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
        _event(conn, rollout.rollout_id, now, event.kind.value, event.edge, event.detail)


def _move(fleet: Fleet, rollout: machine.Rollout, edge: str, now: float) -> None:
    name, version = parse_ref(rollout.model)
    before = previous_model(fleet, edge)
    current = fleet.desired_config(edge)
    published = fleet.registry.get(name, version)
    deployment_id = fleet.deploy(name, version, [edge])
    config = _config(
        lambda: machine.moved_config(
            current,
            fleet=fleet.fleet,
            edge=edge,
            model=rollout.model,
            recommended=recommended_thresholds(fleet.store.conn, published.manifest),
            now=now,
        ),
        edge,
    )
    fleet.push_config(config, now)
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
    edge, before = str(row["edge"]), row["previous_model"]
    deployment_id = None
    if before:
        name, version = parse_ref(str(before))
        deployment_id = fleet.deploy(name, version, [edge])
    previous = (
        None
        if row["previous_config"] is None
        else codec.decode(str(row["previous_config"]).encode(), EdgeConfig)
    )
    config = _config(
        lambda: machine.restored_config(
            fleet.desired_config(edge),
            previous,
            fleet=fleet.fleet,
            edge=edge,
            previous_model=None if before is None else str(before),
            now=now,
        ),
        edge,
    )
    fleet.push_config(config, now)
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


def _event(
    conn: sqlite3.Connection, rollout_id: str, at: float, kind: str, edge: str, detail: str
) -> None:
    conn.execute(
        "INSERT INTO rollout_events (rollout_id, at, kind, edge, detail) VALUES (?,?,?,?,?)",
        (rollout_id, at, kind, edge, detail),
    )

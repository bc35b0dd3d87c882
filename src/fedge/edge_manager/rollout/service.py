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
row) unless the operator forces it, which is recorded. While a rollout is unfinished its
edges are refused to any other deploy or threshold change (rollout_guard.py); its own
writes pass its id.

One rollout cannot stop the others: the driver steps each in its own transaction, and a
step that raises is rolled back, logged, recorded as an ``error`` event and the rollout
paused with that reason (an operator resumes or aborts it).

The statements are rollout_store.py's (the rollouts tables) and rollout_health_store.py's
(what the edges reported).

A completed rollout is watched for a day (:data:`DEGRADED_WATCH_S`): a station that rolls
its model back on its own after completion (possible when the plan does not wait for
the stations' probation verdicts) turns it ``degraded`` and raises a ``local_rollback``
alert naming the station, which an operator acknowledges; ``abort`` sends the rest back.

Not handled: the store's rollouts are driven by one serve process; two serves on one
store would both step them (the write lock keeps each step whole, not single).
"""

import json
import logging
import uuid
from collections.abc import Callable

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.registry.versions import parse_ref
from fedge.edge_manager.rollout import health, machine
from fedge.edge_manager.rollout import health_store as reports
from fedge.edge_manager.rollout import store as rollout_store
from fedge.edge_manager.rollout.guard import active_rollouts_of
from fedge.edge_manager.rollout.machine import EventKind, RolloutState
from fedge.edge_manager.rollout.plan import RolloutError, RolloutPlan
from fedge.edge_manager.rollout.store import record_event
from fedge.edge_manager.rollout.writes import Loaded, halt, load, previous_model, write_step
from fedge.edge_manager.store import Transaction
from fedge.protocols.alerts import AlertKind

log = logging.getLogger(__name__)

# Created in the store, not by the machine (it never sees a rollout before it exists).
CREATED = "created"
# How long a completed rollout is watched for stations rolling its model back on their
# own: the agents' probation lasts minutes (probation_s), a day leaves a wide margin.
DEGRADED_WATCH_S = 86_400.0


def blessed(conn: Transaction, name: str, version: int) -> bool | None:
    """The gate's verdict: its newest row for the model (None: never gated)."""
    return rollout_store.gate_blessed(conn, name, version)


def default_edges(fleet: Fleet, name: str) -> list[str]:
    """The edges whose desired deployment is a version of model ``name`` (what ``rollout
    start`` targets without ``--edges``): the edges that serve that model's line."""
    return [e for e in fleet.edges() if (fleet.deployed_model(e) or ("", 0))[0] == name]


class Rollouts:
    """Operators' side: start, pause, resume, abort (the CLI and the console call these)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.store = fleet.store

    def start(
        self,
        model: str,
        plan: RolloutPlan,
        *,
        now: float,
        force_unblessed: bool = False,
        paused: bool = False,
    ) -> str:
        """A new pending rollout (``serve`` moves its first wave); its id. Refused, with
        nothing written, for an unknown, damaged or unblessed model, an edge that could
        not be rolled back, or an edge already in an unfinished rollout. ``paused``: it
        starts paused, and nothing moves until it is resumed."""
        name, version = parse_ref(model)
        published = self.fleet.registry.get(name, version)
        self.fleet.edges(list(plan.edges))
        published.verify()
        if plan.anomaly is not None:
            # Unknown, damaged, unsigned, not an anomaly model, or not for this
            # classifier's images: refused here, not at every station (issue 28).
            try:
                self.fleet.anomaly_companion(
                    published.manifest, parse_ref(plan.anomaly), images=True
                )
            except ManagerError as exc:
                raise RolloutError(
                    f"cannot roll out {model} with anomaly model {plan.anomaly}: "
                    f"{str(exc).removesuffix('; nothing was changed')}; nothing was started"
                ) from None
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
            rollout_store.insert_rollout(
                conn,
                rollout_id=rollout_id,
                name=name,
                version=version,
                plan=json.dumps(plan.to_json_dict()),
                state=(RolloutState.PAUSED if paused else RolloutState.PENDING).value,
                wave=-1,
                forced_unblessed=force_unblessed and verdict is not True,
                reason="",
                now=now,
                edges=edges,
            )
            waves = ", ".join(f"{w * 100:g}%" for w in plan.waves)
            record_event(
                conn,
                rollout_id,
                now,
                CREATED,
                "",
                f"{model}"
                + ("" if plan.anomaly is None else f" with anomaly model {plan.anomaly}")
                + f" to {len(plan.edges)} edge(s); canary "
                f"{', '.join(plan.canary) or 'none'}; waves {waves}; health window "
                f"{plan.health_window_s:g}s; abort if "
                f"{', '.join(str(c) for c in plan.abort_if)} (and on any failed activation); "
                f"activation timeout {plan.activation_timeout_s:g}s; rollback timeout "
                f"{plan.rollback_timeout_s:g}s; "
                + (
                    f"waits for the stations' probation verdicts ({plan.probation_timeout_s:g}s)"
                    if plan.wait_for_probation
                    else "does not wait for the stations' probation verdicts"
                ),
            )
            if force_unblessed and verdict is not True:
                record_event(
                    conn,
                    rollout_id,
                    now,
                    EventKind.FORCED.value,
                    "",
                    f"{model} is not blessed; rolled out with --force-unblessed",
                )
            if paused:
                record_event(conn, rollout_id, now, EventKind.PAUSED.value, "", "started paused")
        return rollout_id

    def pause(self, rollout_id: str, now: float) -> machine.Step:
        return self._operate(rollout_id, now, lambda loaded: machine.pause(loaded.rollout))

    def resume(self, rollout_id: str, now: float) -> machine.Step:
        return self._operate(rollout_id, now, lambda loaded: machine.resume(loaded.rollout))

    def abort(
        self, rollout_id: str, now: float, reason: str = "by operator", *, force: bool = False
    ) -> machine.Step:
        """Abort a running or paused rollout. ``force`` on one already aborted and still
        waiting for edges to confirm their previous model ends it now (recorded)."""

        def decide(loaded: Loaded) -> machine.Step:
            rollout = loaded.rollout
            if force and rollout.state is RolloutState.ABORTED:
                observed = health.rollout_health(self.store.conn, rollout, loaded.rows)
                return machine.force_finish(rollout, observed)
            return machine.abort(rollout, reason)

        return self._operate(rollout_id, now, decide)

    def _operate(
        self, rollout_id: str, now: float, decide: Callable[[Loaded], machine.Step]
    ) -> machine.Step:
        with self.store.transaction() as conn:
            loaded = load(conn, rollout_id)
            result = decide(loaded)
            write_step(self.fleet, loaded, result, now)
        return result


class RolloutDriver:
    """The serve loop's side: one :meth:`tick` steps every unfinished rollout."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def tick(self, now: float) -> int:
        """Step every unfinished rollout (one transaction each); how many changed. A
        rollout whose step raises is stopped on its own (:meth:`_failed`); the others
        are still stepped."""
        ids = rollout_store.unfinished_ids(self.fleet.store.conn)
        changed = 0
        for rollout_id in ids:
            try:
                changed += self._tick_one(rollout_id, now)
            except Exception as exc:  # one broken rollout must not starve the others
                changed += self._failed(rollout_id, exc, now)
        try:
            changed += self._watch_completed(now)
        except Exception:
            log.exception("cannot check completed rollouts for local rollbacks")
        return changed

    def _watch_completed(self, now: float) -> int:
        """Completed rollouts a station rolled back on its own since: ``degraded``, with a
        ``local_rollback`` alert per station (one transaction per rollout)."""
        found = reports.rolled_back_after_completion(self.fleet.store.conn, now - DEGRADED_WATCH_S)
        by_rollout: dict[str, dict[str, str]] = {}
        for rollout_id, edge, reason in found:
            by_rollout.setdefault(rollout_id, {})[edge] = reason
        for rollout_id, edges in by_rollout.items():
            with self.fleet.store.transaction() as conn:
                loaded = load(conn, rollout_id)
                if loaded.rollout.state is not RolloutState.COMPLETED:
                    continue
                result = machine.degrade(loaded.rollout, edges)
                write_step(self.fleet, loaded, result, now)
                for edge, reason in sorted(edges.items()):
                    alert_store.insert_alert(
                        conn,
                        alert_store.AlertView(
                            alert_id=alert_store.new_alert_id(),
                            edge=edge,
                            model=loaded.rollout.model,
                            kind=AlertKind.LOCAL_ROLLBACK.value,
                            value=1.0,
                            threshold=0.0,
                            detail={"rollout": rollout_id, "reason": reason},
                            raised_at=now,
                            cleared_at=None,
                            cleared_by="",
                        ),
                    )
            log.warning(
                "rollout %s degraded: %s rolled %s back on their own after it completed",
                rollout_id,
                ", ".join(sorted(edges)),
                loaded.rollout.model,
            )
        return len(by_rollout)

    def _failed(self, rollout_id: str, exc: Exception, now: float) -> int:
        """A step that raised (its transaction rolled back). A move that cannot be written
        (a damaged artifact, an unreachable address: a ManagerError) aborts the rollout
        rather than retry it every second; anything else -- or an abort that fails too --
        pauses it with the reason, recorded as an ``error`` event."""
        reason = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ManagerError):
            log.error("rollout %s cannot go on: %s; aborting it", rollout_id, exc)
            try:
                with self.fleet.store.transaction() as conn:
                    loaded = load(conn, rollout_id)
                    if loaded.rollout.state in machine.MOVING | {RolloutState.PAUSED}:
                        write_step(self.fleet, loaded, machine.abort(loaded.rollout, str(exc)), now)
                        return 1
            except Exception as failure:
                reason = f"{exc}; aborting it failed too: {type(failure).__name__}: {failure}"
        log.error("rollout %s stopped by an error: %s", rollout_id, reason, exc_info=exc)
        try:
            return halt(self.fleet.store, rollout_id, reason, now)
        except Exception:
            log.exception("rollout %s: the error could not even be recorded", rollout_id)
            return 0

    def _tick_one(self, rollout_id: str, now: float) -> int:
        with self.fleet.store.transaction() as conn:
            loaded = load(conn, rollout_id)
            observed = health.rollout_health(conn, loaded.rollout, loaded.rows)
            result = machine.step(loaded.rollout, observed, now)
            if not result.changes and result.state is loaded.rollout.state:
                return 0
            write_step(self.fleet, loaded, result, now)
        return 1

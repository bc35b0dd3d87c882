"""Continuous-training policies and runs in the manager's store, and what a policy sees.

A thin adapter: rows in, :class:`~fedge.loop.policy.LoopPolicy` /
:class:`~fedge.loop.pipeline.LoopRun` out. Every state a run enters is written with an
event, in one transaction, so ``fedge loop status`` shows each step it took and a
restarted runner continues from the stored state.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from fedge.edge_manager.store import Store
from fedge.loop.pipeline import LoopRun, RunState
from fedge.loop.policy import LoopPolicy, LoopPolicyError, Observation


def policy_to_json(policy: LoopPolicy) -> str:
    fields = dataclasses.asdict(policy)
    fields["on_alerts"] = sorted(policy.on_alerts)
    fields["canary"] = list(policy.canary)
    return json.dumps(fields, sort_keys=True)


def policy_from_json(text: str) -> LoopPolicy:
    try:
        fields = json.loads(text)
        fields["on_alerts"] = frozenset(fields["on_alerts"])
        fields["canary"] = tuple(fields["canary"])
        return LoopPolicy(**fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise LoopPolicyError(f"stored loop policy cannot be read: {exc}") from None


def save_policy(store: Store, policy: LoopPolicy, now: float | None = None) -> None:
    store.conn.execute(
        "INSERT INTO loop_policies (model, policy, enabled, updated_at) VALUES (?,?,?,?) "
        "ON CONFLICT (model) DO UPDATE SET policy=excluded.policy, enabled=excluded.enabled, "
        "updated_at=excluded.updated_at",
        (policy.model, policy_to_json(policy), int(policy.enabled), now or time.time()),
    )


def policies(store: Store) -> list[LoopPolicy]:
    rows = store.query("SELECT policy FROM loop_policies ORDER BY model")
    return [policy_from_json(str(r["policy"])) for r in rows]


def policy(store: Store, model: str) -> LoopPolicy | None:
    row = store.one("SELECT policy FROM loop_policies WHERE model=?", (model,))
    return None if row is None else policy_from_json(str(row["policy"]))


def observe(store: Store, model: str) -> Observation:
    """New labels and open alerts since this model's last loop run started.

    Labels count from the start of the last run (or ever, before the first): the
    labels a run's job could not have trained on; only labels of predictions a version
    of ``model`` made, and only alerts about a version of ``model``, count.
    """
    last = store.one(
        "SELECT state, started_at FROM loop_runs WHERE model=? ORDER BY started_at DESC LIMIT 1",
        (model,),
    )
    since = 0.0 if last is None else float(last["started_at"])
    running = last is not None and not RunState(str(last["state"])).ended
    # Labels of this model's predictions, given at the manager or on a station's own
    # screen (both are an operator's judgement). substr, not LIKE: "_" in a name is no
    # wildcard.
    prefix = f"{model}:"
    new_labels = int(
        store.scalar(
            "SELECT count(*) FROM labels l WHERE l.at > ? AND EXISTS (SELECT 1 FROM "
            "predictions p WHERE p.prediction_id = l.prediction_id "
            "AND substr(p.model, 1, ?) = ?)",
            (since, len(prefix), prefix),
        )
        or 0
    )
    # Issue 28 item 5: an alert raised on a model at an edge before that model's deployment
    # passed its probation there was judged against the reference of before (the gate's
    # held-out set, or the previous model's traffic), not the model's own; the rollout's
    # criteria judge that period, and the monitor re-bases the reference after the pass.
    # A loop that retrained on it would retrain on its own model's arrival.
    alerts = store.query(
        "SELECT DISTINCT a.edge, a.kind FROM alerts a WHERE a.cleared_at IS NULL "
        "AND a.raised_at > ? AND substr(a.model, 1, ?) = ? AND NOT EXISTS (SELECT 1 "
        "FROM deploy_events e JOIN deployments d ON d.deployment_id = e.deployment_id "
        "WHERE e.edge = a.edge AND d.model_name || ':' || d.model_version = a.model "
        "AND e.at >= a.raised_at AND (e.stage = 'passed' OR (e.stage = 'active' "
        "AND e.reason LIKE 'not on probation%'))) ORDER BY a.edge, a.kind",
        (since, len(prefix), prefix),
    )
    return Observation(
        new_labels=new_labels,
        open_alerts=tuple((str(a["edge"]), str(a["kind"])) for a in alerts),
        running=running,
        last_started_at=None if last is None else since,
    )


def new_run(model: str, trigger: str, now: float) -> LoopRun:
    return LoopRun(
        run_id=f"loop-{uuid.uuid4().hex[:10]}",
        model=model,
        state=RunState.TRAINING,
        trigger=trigger,
        started_at=now,
        updated_at=now,
    )


def save_run(store: Store, run: LoopRun, step: str, detail: str) -> None:
    """Write ``run`` as it is now and the step that made it so (one transaction)."""
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO loop_runs (run_id, model, state, trigger, started_at, updated_at, "
            "job_dir, candidate, rollout_id, reason) VALUES (?,?,?,?,?,?,?,?,?,?) "
            "ON CONFLICT (run_id) DO UPDATE SET state=excluded.state, "
            "updated_at=excluded.updated_at, job_dir=excluded.job_dir, "
            "candidate=excluded.candidate, rollout_id=excluded.rollout_id, "
            "reason=excluded.reason",
            (
                run.run_id,
                run.model,
                run.state.value,
                run.trigger,
                run.started_at,
                run.updated_at,
                run.job_dir,
                run.candidate,
                run.rollout_id,
                run.reason,
            ),
        )
        conn.execute(
            "INSERT INTO loop_events (run_id, at, step, detail) VALUES (?,?,?,?)",
            (run.run_id, run.updated_at, step, detail),
        )


def _run(row: dict[str, object]) -> LoopRun:
    return LoopRun(
        run_id=str(row["run_id"]),
        model=str(row["model"]),
        state=RunState(str(row["state"])),
        trigger=str(row["trigger"]),
        started_at=float(str(row["started_at"])),
        updated_at=float(str(row["updated_at"])),
        job_dir=str(row["job_dir"]),
        candidate=str(row["candidate"]),
        rollout_id=str(row["rollout_id"]),
        reason=str(row["reason"]),
    )


def runs(store: Store, model: str | None = None, limit: int = 20) -> list[LoopRun]:
    if model is None:
        rows = store.query("SELECT * FROM loop_runs ORDER BY started_at DESC LIMIT ?", (limit,))
    else:
        rows = store.query(
            "SELECT * FROM loop_runs WHERE model=? ORDER BY started_at DESC LIMIT ?",
            (model, limit),
        )
    return [_run(r) for r in rows]


def unfinished(store: Store) -> list[LoopRun]:
    ended = [s.value for s in RunState if s.ended]
    marks = ",".join("?" * len(ended))
    rows = store.query(
        f"SELECT * FROM loop_runs WHERE state NOT IN ({marks}) ORDER BY started_at", tuple(ended)
    )
    return [_run(r) for r in rows]


def events(store: Store, run_id: str) -> list[dict[str, object]]:
    return store.query(
        "SELECT at, step, detail FROM loop_events WHERE run_id=? ORDER BY at, rowid", (run_id,)
    )

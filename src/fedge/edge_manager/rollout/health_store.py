"""What a moved edge reported, as a staged rollout's health reads it: the SQL side of
rollout_health.py.

Plain values out of ``deploy_events``, ``edges``, ``telemetry``, ``predictions``,
``labels``, ``models``, ``alerts`` and ``estimates``; rollout_health.py turns them into
abort metrics (minimum evidence, counter restarts, percentiles, agreement). "Since the
move" is by the manager's receive time of a record's batch (``batches.received_at``),
never the station's clock -- see rollout_health.py. Every function takes the connection,
so a read inside a rollout step sees that step's transaction.
"""

import sqlite3


def first_settled_at(conn: sqlite3.Connection, edge: str, deployment_id: str) -> float | None:
    """When ``edge`` first reported ``deployment_id`` active (or passed: active by then),
    failed or rolled back."""
    value = conn.execute(
        "SELECT min(at) FROM deploy_events WHERE edge=? AND deployment_id=? "
        "AND stage IN ('active', 'passed', 'failed', 'rolled_back')",
        (edge, deployment_id),
    ).fetchone()[0]
    return None if value is None else float(value)


def passed_at(conn: sqlite3.Connection, edge: str, deployment_id: str) -> float | None:
    """When ``edge`` first reported ``deployment_id`` passed its probation (None: not yet).

    An ``active`` report that says it is "not on probation" (a model proven on that
    station) is a pass too: an agent of before the explicit ``passed`` sends no other."""
    value = conn.execute(
        "SELECT min(at) FROM deploy_events WHERE edge=? AND deployment_id=? "
        "AND (stage='passed' OR (stage='active' AND reason LIKE 'not on probation%'))",
        (edge, deployment_id),
    ).fetchone()[0]
    return None if value is None else float(value)


def rolled_back_after_completion(
    conn: sqlite3.Connection, since: float
) -> list[tuple[str, str, str]]:
    """(rollout, edge, the agent's reason) for each edge of a rollout completed at or after
    ``since`` that rolled the rollout's deployment back on its own: oldest rollout first."""
    rows = conn.execute(
        "SELECT r.rollout_id, e.edge, min(d.reason) FROM rollouts r "
        "JOIN rollout_edges e ON e.rollout_id = r.rollout_id "
        "JOIN deploy_events d ON d.edge = e.edge AND d.deployment_id = e.deployment_id "
        "WHERE r.state = 'completed' AND r.finished_at >= ? AND d.stage = 'rolled_back' "
        "GROUP BY r.rollout_id, e.edge ORDER BY r.finished_at, e.edge",
        (since,),
    ).fetchall()
    return [(str(r[0]), str(r[1]), str(r[2])) for r in rows]


def activation_failed(conn: sqlite3.Connection, edge: str, deployment_id: str) -> bool:
    """Whether ``edge`` reported ``deployment_id`` failed or rolled back (by the agent)."""
    row = conn.execute(
        "SELECT 1 FROM deploy_events WHERE edge=? AND deployment_id=? "
        "AND stage IN ('failed', 'rolled_back') LIMIT 1",
        (edge, deployment_id),
    ).fetchone()
    return row is not None


def serving_and_applied(conn: sqlite3.Connection, edge: str) -> tuple[str, int] | None:
    """(model ref served, config version applied) as ``edge`` last reported (None: no edge)."""
    row = conn.execute("SELECT serving, config_applied FROM edges WHERE edge=?", (edge,)).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


# Telemetry records with the manager's receive time of their batch.
_RECEIVED_TELEMETRY = (
    "SELECT t.value FROM telemetry t JOIN batches b ON b.edge = t.edge "
    "AND b.stream = 'telemetry' AND b.seq = t.seq WHERE t.edge=? AND t.name=? "
)


def counter_before(conn: sqlite3.Connection, edge: str, name: str, since: float) -> float | None:
    """The last value of ``edge``'s telemetry counter ``name`` received before ``since``
    (None: none)."""
    row = conn.execute(
        _RECEIVED_TELEMETRY + "AND b.received_at < ? ORDER BY t.seq DESC, t.idx DESC LIMIT 1",
        (edge, name, since),
    ).fetchone()
    return None if row is None else float(row[0])


def counter_since(conn: sqlite3.Connection, edge: str, name: str, since: float) -> list[float]:
    """The values of ``edge``'s telemetry counter ``name`` received at or after ``since``,
    in the agent's order."""
    return [
        float(v)
        for (v,) in conn.execute(
            _RECEIVED_TELEMETRY + "AND b.received_at >= ? ORDER BY t.seq, t.idx",
            (edge, name, since),
        )
    ]


# Predictions of an edge whose batch the manager received at or after a time.
_RECEIVED_PREDICTION = (
    "JOIN batches b ON b.edge = p.edge AND b.stream = 'predictions' AND b.seq = p.seq "
    "WHERE p.edge=? AND b.received_at >= ? "
)


def _beside(anomaly: str | None) -> tuple[str, tuple[str, ...]]:
    """The filter on the anomaly model scored beside (None: any, or none)."""
    return ("", ()) if anomaly is None else ("AND p.anomaly_model=? ", (anomaly,))


def latencies_since(
    conn: sqlite3.Connection, edge: str, model: str, since: float, anomaly: str | None = None
) -> list[float]:
    """The latencies of ``model``'s predictions on ``edge`` received at or after ``since``
    (scored beside ``anomaly`` when given)."""
    beside, args = _beside(anomaly)
    return [
        float(v)
        for (v,) in conn.execute(
            "SELECT p.latency_ms FROM predictions p "
            + _RECEIVED_PREDICTION
            + "AND p.model=? "
            + beside,
            (edge, since, model, *args),
        )
    ]


def novel_counts_since(
    conn: sqlite3.Connection, edge: str, model: str, since: float, anomaly: str | None = None
) -> tuple[int, int]:
    """(novel, with a verdict) among ``model``'s predictions on ``edge`` received at or
    after ``since`` (issue 28; ``novel`` NULL: no verdict), scored beside ``anomaly``
    when given."""
    beside, args = _beside(anomaly)
    row = conn.execute(
        "SELECT coalesce(sum(p.novel), 0), count(p.novel) FROM predictions p "
        + _RECEIVED_PREDICTION
        + "AND p.model=? "
        + beside,
        (edge, since, model, *args),
    ).fetchone()
    return int(row[0]), int(row[1])


def manifest_json(conn: sqlite3.Connection, name: str, version: int) -> str | None:
    """The manifest JSON of ``name:version`` in the registry (None: not published)."""
    row = conn.execute(
        "SELECT manifest FROM models WHERE name=? AND version=?", (name, version)
    ).fetchone()
    return None if row is None else str(row[0])


# The current label of each labelled prediction chosen by `{chosen}` (one decision each).
_LABELLED = (
    "SELECT p.decision, l.label FROM labels l JOIN (SELECT p.prediction_id, p.decision "
    "{chosen} GROUP BY p.prediction_id) p ON p.prediction_id = l.prediction_id"
)


def labelled_decisions_since(
    conn: sqlite3.Connection, edge: str, model: str, since: float
) -> list[tuple[str, str]]:
    """(decision, current label) of ``model``'s labelled predictions on ``edge`` whose
    batch was received at or after ``since``."""
    chosen = "FROM predictions p " + _RECEIVED_PREDICTION + "AND p.model=? "
    rows = conn.execute(_LABELLED.format(chosen=chosen), (edge, since, model)).fetchall()
    return [(str(decision), str(label)) for decision, label in rows]


def labelled_decisions(conn: sqlite3.Connection, edge: str, model: str) -> list[tuple[str, str]]:
    """(decision, current label) of all ``model``'s labelled predictions on ``edge`` --
    old ones whose batch keys retention pruned too."""
    chosen = "FROM predictions p WHERE p.edge=? AND p.model=? "
    rows = conn.execute(_LABELLED.format(chosen=chosen), (edge, model)).fetchall()
    return [(str(decision), str(label)) for decision, label in rows]


def open_alert_count(conn: sqlite3.Connection, edge: str, model: str, since: float) -> int:
    """Open alerts about ``model`` raised on ``edge`` at or after ``since``."""
    count = conn.execute(
        "SELECT count(*) FROM alerts WHERE edge=? AND model=? AND raised_at >= ? "
        "AND cleared_at IS NULL",
        (edge, model, since),
    ).fetchone()[0]
    return int(count)


# The MPP estimate of an edge and model over the windows chosen, weighted by window size.
_MEAN_ESTIMATE = (
    "SELECT sum(mpp * n) / sum(n) FROM estimates WHERE edge=? AND model=? AND {when} "
    "AND mpp IS NOT NULL AND n > 0"
)


def mean_estimate_ending_after(
    conn: sqlite3.Connection, edge: str, model: str, at: float
) -> float | None:
    """``model``'s mean MPP estimate on ``edge`` over windows ending after ``at``."""
    return _mean_estimate(conn, _MEAN_ESTIMATE.format(when="window_end > ?"), edge, model, at)


def mean_estimate_starting_from(
    conn: sqlite3.Connection, edge: str, model: str, at: float
) -> float | None:
    """``model``'s mean MPP estimate on ``edge`` over windows starting at or after ``at``."""
    return _mean_estimate(conn, _MEAN_ESTIMATE.format(when="window_start >= ?"), edge, model, at)


def _mean_estimate(
    conn: sqlite3.Connection, sql: str, edge: str, model: str, at: float
) -> float | None:
    value = conn.execute(sql, (edge, model, at)).fetchone()[0]
    return None if value is None else float(value)

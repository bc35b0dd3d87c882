"""What a moved edge reported since it moved: the abort metrics of a staged rollout.

Read from the manager's store (an adapter: the values rollout_health_store.py reads in,
:class:`EdgeHealth` out). Every
metric covers the edge's reports since ``moved_at`` and is left out while there is
too little to judge it on (no labels yet, too few images, no estimate yet), so a
criterion never trips on missing evidence -- except ``failed_activation``, which is 0
until the edge says otherwise, and is read whatever the criteria (it always aborts).

- ``failed_activation``: 1 if the edge reported the rollout's deployment ``failed`` or
  ``rolled_back`` (the agent's own rollback after its local health checks), else 0.
- ``error_rate``: inference errors over attempts, from the agent's cumulative telemetry
  counters ``inference.errors`` and ``predictions`` (increments since the move; a counter
  that went down means the agent restarted and counts from zero); judged once at least
  MIN_ERROR_RATE_IMAGES images were scored or failed (one error in two images is no rate).
- ``latency_p95_ms``: of the new model's predictions on the edge (nearest rank).
- ``agreement_drop``: label agreement of the previous model's predictions on the edge
  minus the new model's (labels.agreement's rule: a label agrees with "reject" when it
  names a positive class), once each side has MIN_AGREEMENT_LABELS labels.
- ``alerts``: open alerts about the rollout's model raised on the edge since it moved
  (an alert about the previous model is not the new model's fault).
- ``est_accuracy_drop``: the previous model's MPP estimate on the edge minus the new
  model's (``estimates``, weighted by window size).
- ``novel_rate`` (issue 28): the new model's novel parts -- not recognised as a known defect
  (``PredictionRecord.novel``), scored over the station's anomaly threshold by the
  anomaly model served beside it -- over its parts with an anomaly verdict, once there
  are MIN_NOVEL_IMAGES: a classifier that passes what the anomaly model calls unusual at
  a rate its false alarms do not explain.

A rollout carrying an anomaly model (issue 28) judges the pair: ``novel_rate`` and
``latency_p95_ms`` count only predictions scored beside that anomaly model (a rollout
that changes only the anomaly model has the classifier the edge served before, so the
classifier alone cannot tell the new pair's predictions from the old one's), and an edge
sent back is back only once it also reported the restoring deployment -- its previous
pair -- active (what it serves names only the classifier).

Clock domains. ``moved_at`` is the manager's time; a prediction's or telemetry record's
``at`` is the station's. "Since the move" is therefore judged by when the manager
received the record's batch (``batches.received_at``, manager time), and predictions
are also filtered by ``model``; a station whose clock is off cannot move a report to the
wrong side of the move. Not handled: ``estimates`` windows (``window_end``) are in
station time and are compared with ``moved_at`` as they are -- a skewed station clock
shifts which estimate windows count as the new model's (they are filtered by model, so
only the boundary window is affected). Batches whose keys retention pruned no longer
count as received before the move; moves are recent, retention keeps days.
"""

import json
import math
from collections.abc import Callable, Iterable, Mapping

from fedge.edge_manager.rollout import health_store as reports
from fedge.edge_manager.rollout.machine import EdgeHealth, EdgeState, Rollout
from fedge.edge_manager.rollout.plan import Metric, RolloutError
from fedge.edge_manager.rollout.store import RolloutEdgeRow
from fedge.edge_manager.store import Transaction

# The agent's telemetry counters (cumulative since it started) behind error_rate.
ERRORS_METRIC = "inference.errors"
SCORED_METRIC = "predictions"
# Labelled predictions an agreement_drop needs on each side (new and previous model).
MIN_AGREEMENT_LABELS = 20
# Images scored or failed since the move before an error_rate is judged.
MIN_ERROR_RATE_IMAGES = 20
# Parts with an anomaly verdict since the move before a novel_rate is judged.
MIN_NOVEL_IMAGES = 20


def settled_at(conn: Transaction, edge: str, deployment_id: str) -> float | None:
    """When ``edge`` first reported ``deployment_id`` active, failed or rolled back."""
    return reports.first_settled_at(conn, edge, deployment_id)


def rollout_health(
    conn: Transaction, rollout: Rollout, rows: Mapping[str, RolloutEdgeRow]
) -> dict[str, EdgeHealth]:
    """The health of every moved or rolling-back edge of ``rollout`` (``rows``: its
    stored edges by edge)."""
    metrics = [c.metric for c in rollout.plan.abort_if]
    found: dict[str, EdgeHealth] = {}
    for edge in rollout.edges:
        row = rows[edge.edge]
        previous = row.previous_model or ""
        if edge.state is EdgeState.MOVED:
            if row.moved_at is None:  # a damaged row: its window is not guessed at
                raise RolloutError(
                    f"rollout {rollout.rollout_id}: {edge.edge} is moved but not when"
                )
            found[edge.edge] = moved_health(
                conn,
                edge=edge.edge,
                model=rollout.model,
                previous_model=previous,
                deployment_id=str(row.deployment_id),
                moved_at=row.moved_at,
                metrics=metrics,
                anomaly=rollout.plan.anomaly,
            )
        elif edge.state is EdgeState.ROLLING_BACK:
            restored = row.restore_config_version or 0
            back = is_back(conn, edge.edge, previous, restored)
            if back and rollout.plan.anomaly is not None and row.restore_deployment_id:
                back = restore_active(conn, edge.edge, row.restore_deployment_id)
            found[edge.edge] = EdgeHealth(back=back)
    return found


def moved_health(
    conn: Transaction,
    *,
    edge: str,
    model: str,
    previous_model: str,
    deployment_id: str,
    moved_at: float,
    metrics: Iterable[Metric],
    anomaly: str | None = None,
) -> EdgeHealth:
    """The health of an edge on the rollout's model (and ``anomaly``, the anomaly model
    beside it, if the rollout carries one), for the metrics asked for (and whether it
    failed to activate, always)."""
    failed = failed_activation(conn, edge, deployment_id)
    readers: dict[Metric, Callable[[], float | None]] = {
        Metric.FAILED_ACTIVATION: lambda: failed,
        Metric.ERROR_RATE: lambda: error_rate(conn, edge, moved_at),
        Metric.LATENCY_P95_MS: lambda: latency_p95_ms(conn, edge, model, moved_at, anomaly),
        Metric.AGREEMENT_DROP: lambda: agreement_drop(conn, edge, model, previous_model, moved_at),
        Metric.ALERTS: lambda: open_alerts(conn, edge, model, moved_at),
        Metric.EST_ACCURACY_DROP: lambda: estimate_drop(
            conn, edge, model, previous_model, moved_at
        ),
        Metric.NOVEL_RATE: lambda: novel_rate(conn, edge, model, moved_at, anomaly),
    }
    observed: dict[str, float] = {}
    for metric in metrics:
        value = readers[metric]()
        if value is not None:
            observed[metric.value] = value
    return EdgeHealth(
        settled_at=settled_at(conn, edge, deployment_id),
        metrics=observed,
        failed=failed > 0,
        passed_at=reports.passed_at(conn, edge, deployment_id),
    )


def is_back(conn: Transaction, edge: str, previous_model: str, restore_config_version: int) -> bool:
    """Whether ``edge`` serves its previous model and applied its restored thresholds."""
    row = reports.serving_and_applied(conn, edge)
    return row is not None and row[0] == previous_model and row[1] >= restore_config_version


def restore_active(conn: Transaction, edge: str, restore_deployment_id: str) -> bool:
    """Whether ``edge`` reported the deployment that sends it back active (not failed)."""
    return reports.first_settled_at(
        conn, edge, restore_deployment_id
    ) is not None and not reports.activation_failed(conn, edge, restore_deployment_id)


def failed_activation(conn: Transaction, edge: str, deployment_id: str) -> float:
    return 1.0 if reports.activation_failed(conn, edge, deployment_id) else 0.0


def error_rate(conn: Transaction, edge: str, since: float) -> float | None:
    """Errors over attempts since ``since`` (manager time), once there are enough."""
    errors = _counter_increase(conn, edge, ERRORS_METRIC, since)
    scored = _counter_increase(conn, edge, SCORED_METRIC, since)
    attempts = (errors or 0.0) + (scored or 0.0)
    if errors is None or attempts < MIN_ERROR_RATE_IMAGES:
        return None
    return errors / attempts


def _counter_increase(conn: Transaction, edge: str, name: str, since: float) -> float | None:
    """How much a cumulative counter grew since ``since`` (None: never reported since),
    by the manager's receive time (batches are received in the agent's order)."""
    before = reports.counter_before(conn, edge, name, since)
    values = reports.counter_since(conn, edge, name, since)
    if not values:
        return None
    last = 0.0 if before is None else before
    grown = 0.0
    for value in values:
        grown += value - last if value >= last else value  # a restart counts from 0
        last = value
    return grown


def latency_p95_ms(
    conn: Transaction, edge: str, model: str, since: float, anomaly: str | None = None
) -> float | None:
    latencies = sorted(reports.latencies_since(conn, edge, model, since, anomaly))
    if not latencies:
        return None
    return latencies[max(0, math.ceil(0.95 * len(latencies)) - 1)]


def agreement(
    conn: Transaction,
    edge: str,
    model: str,
    *,
    since: float = 0.0,
    min_labels: int = 1,
) -> float | None:
    """Share of ``model``'s labelled predictions on ``edge`` (received at or after
    ``since``, manager time) whose decision their current label agrees with; None with
    fewer than ``min_labels``."""
    manifest = reports.manifest_json(conn, *_ref(model))
    positives = set() if manifest is None else set(json.loads(manifest)["positive_classes"])
    if since > 0:
        rows = reports.labelled_decisions_since(conn, edge, model, since)
    else:  # all of them: old predictions whose batch keys retention pruned count too
        rows = reports.labelled_decisions(conn, edge, model)
    if not rows or len(rows) < min_labels:
        return None
    agree = sum(1 for decision, label in rows if (decision == "reject") == (label in positives))
    return agree / len(rows)


def agreement_drop(
    conn: Transaction, edge: str, model: str, previous_model: str, since: float
) -> float | None:
    # Judged once both sides rest on MIN_AGREEMENT_LABELS labels: one disagreeing label
    # on a canary would otherwise be an agreement of 0 and abort a good model.
    new = agreement(conn, edge, model, since=since, min_labels=MIN_AGREEMENT_LABELS)
    old = agreement(conn, edge, previous_model, min_labels=MIN_AGREEMENT_LABELS)
    return None if new is None or old is None else old - new


def novel_rate(
    conn: Transaction, edge: str, model: str, since: float, anomaly: str | None = None
) -> float | None:
    """Novel parts over parts with an anomaly verdict, of ``model``'s predictions on
    ``edge`` received since ``since`` (scored beside ``anomaly`` when given); None below
    MIN_NOVEL_IMAGES verdicts."""
    novel, judged = reports.novel_counts_since(conn, edge, model, since, anomaly)
    return None if judged < MIN_NOVEL_IMAGES else novel / judged


def open_alerts(conn: Transaction, edge: str, model: str, since: float) -> float:
    """Open alerts about ``model`` raised on ``edge`` since ``since`` (both manager time)."""
    return float(reports.open_alert_count(conn, edge, model, since))


def estimate_drop(
    conn: Transaction, edge: str, model: str, previous_model: str, since: float
) -> float | None:
    new = reports.mean_estimate_ending_after(conn, edge, model, since)
    old = reports.mean_estimate_starting_from(conn, edge, previous_model, 0.0)
    return None if new is None or old is None else old - new


def _ref(model: str) -> tuple[str, int]:
    name, _, version = model.rpartition(":")
    return name, int(version) if version.isdigit() else -1

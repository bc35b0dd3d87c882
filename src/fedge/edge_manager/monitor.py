"""The manager's monitor: drift and label-free accuracy of every edge's serving model.

``serve`` calls :meth:`Monitor.tick` every ``monitor_interval_s`` on its worker thread
(the store's one writer). Per edge and the model it serves, a tick reads

- the **reference window**: the model's rows in ``evaluations`` for that edge when the
  validation gate evaluated it there (at least ``min_window`` distinct images, as they
  are: never the stations' re-lit copies, which are synthetic drift), else the model's
  first ``min_window`` predictions on that edge;
- the **current window**: the newest ``min_window`` predictions of the model on the edge
  (for drift against a prediction reference, only those after the reference window);

and judges them (:mod:`fedge.edge_manager.alert_rules`): input and score drift, and the
MPP estimate of accuracy (Ghanta et al., OpML'19) from a predictor fitted on the model's
evaluation rows -- the held-out images and their re-lit copies (``monitoring.relight``),
so it has seen lighting change -- kept in ``mpp_models``. Estimates go to ``estimates``;
alerts are raised and cleared in ``alerts`` and returned, for ``serve`` to publish on the
alerts topic.

A pair whose newest prediction and evaluations did not change since the last tick is not
judged again: with nothing new, no finding can change. Alerts follow the sliding window;
estimates are recorded once per ``min_window`` predictions (windows that do not overlap).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass, replace
from typing import Any

from fedge.edge_manager import alert_store
from fedge.edge_manager.alert_rules import (
    Clear,
    Finding,
    MonitorPolicy,
    Raise,
    Rearm,
    WindowRow,
    accuracy_finding,
    drift_findings,
    estimate,
    mpp_training_set,
    transitions,
)
from fedge.edge_manager.alert_store import AlertView
from fedge.edge_manager.store import Store
from fedge.monitoring.drift import DriftPolicy
from fedge.monitoring.mpp import MppPredictor
from fedge.protocols.alerts import Alert

log = logging.getLogger(__name__)

_WINDOW_SQL = (
    "SELECT p.rowid AS rid, p.at, p.scores, p.stats, l.label FROM predictions p "
    "LEFT JOIN labels l ON l.prediction_id = p.prediction_id "
    "WHERE p.edge=? AND p.model=? ORDER BY p.rowid {order} LIMIT ?"
)


@dataclass(frozen=True)
class _Reference:
    rows: tuple[WindowRow, ...]
    source: str  # "evaluations" or "predictions"
    last_rowid: int  # predictions after it are the current window's (0 for evaluations)
    n_evaluations: int = 0  # the evaluation rows it was read from


@dataclass(frozen=True)
class _Fitted:
    n_rows: int
    predictor: MppPredictor | None


def policy_from(min_window: int, min_estimated_accuracy: float) -> MonitorPolicy:
    return MonitorPolicy(DriftPolicy(min_window=min_window), min_estimated_accuracy)


def _json_map(text: object) -> dict[str, float] | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _row(record: dict[str, Any]) -> WindowRow:
    label = record.get("label")
    return WindowRow(
        scores=_json_map(record["scores"]) or {},
        stats=_json_map(record["stats"]),
        at=float(record["at"]),
        label=None if label is None else str(label),
    )


class Monitor:
    def __init__(self, store: Store, fleet: str, policy: MonitorPolicy) -> None:
        self.store = store
        self.fleet = fleet
        self.policy = policy
        self._references: dict[tuple[str, str], _Reference] = {}
        self._fitted: dict[str, _Fitted] = {}
        self._seen: dict[tuple[str, str], tuple[int, int, int]] = {}
        # (edge, model) -> the time of the newest prediction judged (what tests wait on).
        self.judged: dict[tuple[str, str], float] = {}

    def tick(self, now: float) -> list[Alert]:
        """Judge every serving (edge, model); return the alerts raised and cleared."""
        events: list[AlertView] = []
        serving = [
            (str(r["edge"]), str(r["serving"]))
            for r in self.store.query("SELECT edge, serving FROM edges WHERE serving != ''")
        ]
        with self.store.transaction() as conn:
            for edge, model in serving:
                conn.execute("SAVEPOINT pair")
                try:
                    events += self._judge(conn, edge, model, now)
                except Exception:
                    # One edge's bad data (or a bug it triggers) must not stop the others
                    # being watched; it is judged again when its next predictions arrive.
                    conn.execute("ROLLBACK TO pair")
                    log.exception("monitor could not judge %s on %s", model, edge)
                conn.execute("RELEASE pair")
            events += self._clear_unserved(conn, set(serving), now)
            for view in alert_store.unpublished_acks(self.store):
                alert_store.mark_ack_published(conn, view.alert_id, now)
                events.append(view)
        return [view.message(self.fleet) for view in events]

    # -- one (edge, model)

    def _judge(
        self, conn: sqlite3.Connection, edge: str, model: str, now: float
    ) -> list[AlertView]:
        window = self.policy.min_window
        newest = self.store.query(_WINDOW_SQL.format(order="DESC"), (edge, model, window))
        if len(newest) < window:
            return []  # not a full window yet: nothing to judge
        model_evals, edge_evals = self._evaluation_counts(edge, model)
        key = (int(newest[0]["rid"]), model_evals, edge_evals)
        if self._seen.get((edge, model)) == key:
            return []
        self._seen[(edge, model)] = key
        oldest_first = list(reversed(newest))
        current = [_row(r) for r in oldest_first]
        predictor = self._predictor(conn, model, model_evals, now)
        result = estimate(current, predictor)
        if result.window_start > alert_store.last_estimate_end(self.store, edge, model):
            # Estimates are recorded per window, windows not overlapping (one row per
            # `min_window` predictions); alerts follow the sliding window.
            alert_store.write_estimate(conn, edge, model, result)
        reference = self._reference(edge, model, edge_evals)
        # Against its first predictions, an edge's window is judged once it is past them.
        drift_current = [
            row
            for row, record in zip(current, oldest_first, strict=True)
            if int(record["rid"]) > reference.last_rowid
        ]
        findings = [
            *drift_findings(
                reference.rows, drift_current, self.policy.drift, reference_source=reference.source
            ),
            accuracy_finding(result, self.policy.min_estimated_accuracy),
        ]
        events = self._apply(conn, edge, model, findings, now)
        self.judged[(edge, model)] = result.window_end
        return events

    def _apply(
        self,
        conn: sqlite3.Connection,
        edge: str,
        model: str,
        findings: list[Finding],
        now: float,
    ) -> list[AlertView]:
        actions = transitions(
            alert_store.open_alerts(self.store, edge, model),
            alert_store.acknowledged(self.store, edge, model),
            findings,
        )
        events: list[AlertView] = []
        for action in actions:
            if isinstance(action, Raise):
                finding = action.finding
                view = AlertView(
                    alert_id=alert_store.new_alert_id(),
                    edge=edge,
                    model=model,
                    kind=finding.kind.value,
                    value=finding.value,
                    threshold=finding.threshold,
                    detail=dict(finding.detail),
                    raised_at=now,
                    cleared_at=None,
                    cleared_by="",
                )
                alert_store.insert_alert(conn, view)
                log.warning(
                    "alert %s: %s on %s (%s %.3f, threshold %.3f)",
                    view.alert_id,
                    view.kind,
                    edge,
                    model,
                    view.value,
                    view.threshold,
                )
                events.append(view)
            elif isinstance(action, Clear):
                events += self._clear(conn, action, now)
            elif isinstance(action, Rearm):
                alert_store.rearm(conn, edge, model, action.kind, now)
        return events

    def _clear(self, conn: sqlite3.Connection, action: Clear, now: float) -> list[AlertView]:
        if not alert_store.clear_alert(conn, action.alert_id, now):
            return []
        view = alert_store.get_alert(self.store, action.alert_id)
        log.info("alert %s cleared: %s on %s", view.alert_id, view.kind, view.edge)
        if action.finding is not None:
            view = replace(view, value=action.finding.value)
        return [view]

    def _clear_unserved(
        self, conn: sqlite3.Connection, serving: set[tuple[str, str]], now: float
    ) -> list[AlertView]:
        """Alerts of a model an edge no longer serves: nothing watches them, so they close."""
        events: list[AlertView] = []
        for edge, model, alert in alert_store.open_pairs(self.store):
            if (edge, model) not in serving:
                events += self._clear(conn, Clear(alert.alert_id, alert.kind, None), now)
        return events

    # -- windows and the MPP predictor

    def _evaluation_counts(self, edge: str, model: str) -> tuple[int, int]:
        """The model's evaluation rows (all: the MPP fit's), and this edge's rows of
        images as they are (the reference's)."""
        row = self.store.one(
            "SELECT count(*) AS n, coalesce(sum(edge = ? AND augmented = 0), 0) AS here "
            "FROM evaluations WHERE model=?",
            (edge, model),
        )
        return (0, 0) if row is None else (int(row["n"]), int(row["here"]))

    def _reference(self, edge: str, model: str, edge_evals: int) -> _Reference:
        window = self.policy.min_window
        cached = self._references.get((edge, model))
        if edge_evals >= window:
            if (
                cached is not None
                and cached.source == "evaluations"
                and (cached.n_evaluations == edge_evals)
            ):
                return cached
            # One row per held-out image (the gate may have evaluated the model twice),
            # as it is: a re-lit copy would widen the reference and hide lighting drift.
            rows = self.store.query(
                "SELECT scores, stats, max(at) AS at, NULL AS label FROM evaluations "
                "WHERE edge=? AND model=? AND augmented = 0 GROUP BY prediction_id",
                (edge, model),
            )
            if len(rows) >= window:
                cached = _Reference(tuple(_row(r) for r in rows), "evaluations", 0, edge_evals)
                self._references[(edge, model)] = cached
                return cached
        if cached is not None and cached.source == "predictions":
            return cached
        rows = self.store.query(_WINDOW_SQL.format(order="ASC"), (edge, model, window))
        reference = _Reference(
            tuple(_row(r) for r in rows), "predictions", int(rows[-1]["rid"]) if rows else 0
        )
        if len(rows) >= window:
            self._references[(edge, model)] = reference  # the first window never changes
        return reference

    def _predictor(
        self, conn: sqlite3.Connection, model: str, n_rows: int, now: float
    ) -> MppPredictor | None:
        """The model's MPP predictor, fitted once per set of evaluation rows and stored."""
        fitted = self._fitted.get(model)
        if fitted is not None and fitted.n_rows == n_rows:
            return fitted.predictor
        predictor: MppPredictor | None = None
        stored = self.store.one("SELECT predictor, n_rows FROM mpp_models WHERE model=?", (model,))
        if stored is not None and int(stored["n_rows"]) == n_rows:
            try:
                predictor = MppPredictor.from_json(str(stored["predictor"]))
            except ValueError as exc:
                log.warning("stored MPP predictor of %s is unusable (%s); refitting", model, exc)
        if predictor is None and n_rows > 0:
            predictor = self._fit(conn, model, n_rows, now)
        self._fitted[model] = _Fitted(n_rows, predictor)
        return predictor

    def _fit(
        self, conn: sqlite3.Connection, model: str, n_rows: int, now: float
    ) -> MppPredictor | None:
        # Every row, re-lit copies included (same label as their image): outside the
        # held-out lighting a predictor fitted on in-distribution rows only extrapolates
        # (Guillory et al., ICCV'21; `fedge bench mpp`, mpp vs mpp_plain).
        rows = self.store.query(
            "SELECT scores, stats, at, label FROM evaluations WHERE model=?", (model,)
        )
        features, correct = mpp_training_set([_row(r) for r in rows])
        try:
            predictor = MppPredictor.fit(features, correct)
        except ValueError as exc:
            log.info("no MPP predictor for %s yet: %s", model, exc)
            return None
        conn.execute(
            "INSERT OR REPLACE INTO mpp_models (model, predictor, n_rows, accuracy, fitted_at) "
            "VALUES (?,?,?,?,?)",
            (model, predictor.to_json(), n_rows, predictor.fit_accuracy, now),
        )
        log.info(
            "fitted the MPP predictor of %s on %d evaluation rows (accuracy %.3f)",
            model,
            len(features),
            predictor.fit_accuracy,
        )
        return predictor

"""The manager's monitor: drift and label-free accuracy of every edge's serving model.

``serve`` calls :meth:`Monitor.tick` every ``monitor_interval_s`` on its worker thread
(the store's one writer). Per edge and the model it serves, a tick reads

- the **reference window**: once the edge reported the model's deployment passed its
  probation there, its first ``min_window`` predictions of that deployment (issue 28
  item 5: the reference follows the model, see ``Windows.reference``), else the model's rows in
  ``evaluations`` for that edge when the validation gate evaluated it there (at least
  ``min_window`` distinct images, as they are: never the stations' re-lit copies, which
  are synthetic drift), else the model's first ``min_window`` predictions on that edge;
- the **current window**: the newest ``min_window`` predictions of the model among the
  edge's newest ``SCAN_WINDOWS * min_window`` (for drift against a prediction reference,
  only those after the reference window); an edge that just switched models is judged
  once the new one has a full window there;

and judges them (:mod:`fedge.edge_manager.monitor.rules`): input and score drift, and the
MPP estimate of accuracy (Ghanta et al., OpML'19) from a predictor fitted on the model's
evaluation rows -- the held-out images and their re-lit copies (``monitoring.relight``),
so it has seen lighting change -- kept in ``mpp_models``; and, where an anomaly model
serves beside the classifier, the rate of novel parts
(:mod:`fedge.edge_manager.monitor.novel`, issue 28). Estimates go to ``estimates``;
alerts are raised and cleared in ``alerts`` and returned, for ``serve`` to publish on the
alerts topic.

A pair whose newest prediction, evaluations and relabels did not change since the last
tick is not judged again: with nothing new, no finding can change. Alerts follow the
sliding window, with hysteresis (``alert_rules``); estimates are recorded once per
``min_window`` predictions (windows that do not overlap).

**Locking.** ``serve``'s worker also ingests, and CLI writers wait for the write lock
(30 s), so a tick never holds it for long: it reads (one grouped count of evaluation rows
per tick, bounded index walks over predictions) outside any transaction, and writes each
pair's estimate and alert changes in their own short ``BEGIN IMMEDIATE``, reading the open
alerts and acknowledgements inside it (an operator may acknowledge meanwhile). The
alert messages are built inside that transaction, so one that cannot be built rolls its
pair back rather than leaving a stored alert nobody hears of; an operator's clearing is
marked announced only once ``publish`` accepted it.

What is read, and how (the MPP fit's labels, the persisted references, what a gate
reference is not), is :mod:`fedge.edge_manager.monitor.windows`'s; the statements are
:mod:`fedge.edge_manager.monitor.store`'s and :mod:`fedge.edge_manager.monitor.alert_store`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor import store as monitor_store
from fedge.edge_manager.monitor.alert_store import AlertView
from fedge.edge_manager.monitor.novel import grade, novel_finding
from fedge.edge_manager.monitor.rules import (
    Clear,
    Estimate,
    Finding,
    MonitorPolicy,
    OpenAlert,
    Raise,
    Rearm,
    accuracy_finding,
    drift_findings,
    estimate,
    transitions,
    with_off_delay,
)
from fedge.edge_manager.monitor.windows import Windows, row
from fedge.edge_manager.store import Store, Transaction
from fedge.monitoring.drift import DriftPolicy
from fedge.protocols.alerts import MONITOR_KINDS, Alert, AlertKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Judgement:
    """What one pair's read produced, for its short write transaction."""

    key: tuple[int, int, int, int]
    result: Estimate
    record_estimate: bool
    findings: list[Finding]
    new_reference: tuple[int, int, str] | None  # a prediction reference to persist


Publish = Callable[[Alert], bool]
"""Publishes one alert; True once the transport accepted it."""


def policy_from(min_window: int, min_estimated_accuracy: float) -> MonitorPolicy:
    """The policy ``serve`` runs with (hysteresis at the defaults of MonitorPolicy)."""
    return MonitorPolicy(DriftPolicy(min_window=min_window), min_estimated_accuracy)


class Monitor:
    def __init__(self, store: Store, fleet: str, policy: MonitorPolicy) -> None:
        self.store = store
        self.fleet = fleet
        self.policy = policy
        self.windows = Windows(store, policy)
        self._seen: dict[tuple[str, str], tuple[int, int, int, int]] = {}
        # (edge, model, drift kind) -> the newest prediction rowid when it last held.
        self._held: dict[tuple[str, str, AlertKind], int] = {}
        # (edge, model) -> the time of the newest prediction judged (what tests wait on).
        self.judged: dict[tuple[str, str], float] = {}

    def tick(self, now: float, publish: Publish | None = None) -> list[Alert]:
        """Judge every serving (edge, model); return the alerts raised and cleared.

        With ``publish``, every alert returned was handed to it, and an operator's clearing
        is marked announced only when it returned True (else it is offered again next
        tick). Without, the caller is trusted to publish what is returned.
        """
        alerts: list[Alert] = []
        serving = monitor_store.serving(self.store)
        counts = self.windows.evaluation_counts({model for _, model in serving})
        relabels = monitor_store.newest_relabel(self.store)
        for edge, model in serving:
            try:
                alerts += self._judge(edge, model, counts, relabels, now)
            except Exception:
                # One edge's bad data (or a bug it triggers) must not stop the others
                # being watched; nothing of the pair was written, it is judged next tick.
                log.exception("monitor could not judge %s on %s", model, edge)
        try:
            unserved = [
                alert
                for edge, model, alert in alert_store.open_pairs(self.store)
                if (edge, model) not in set(serving) and alert.kind in MONITOR_KINDS
            ]
            if unserved:
                with self.store.transaction() as conn:
                    views = self._clear_unserved(conn, unserved, now)
                    alerts += [view.message(self.fleet) for view in views]
        except Exception:
            log.exception("monitor could not clear the alerts of models no longer served")
        if publish is not None:
            for alert in alerts:
                publish(alert)
        alerts += self._announce_acks(now, publish)
        return alerts

    def _announce_acks(self, now: float, publish: Publish | None) -> list[Alert]:
        announced: list[Alert] = []
        for view in alert_store.unpublished_acks(self.store):
            try:
                alert = view.message(self.fleet)
            except Exception:
                log.exception("cannot announce the clearing of alert %s", view.alert_id)
                continue
            if publish is not None and not publish(alert):
                continue  # not accepted: offered again at the next tick
            with self.store.transaction() as conn:
                alert_store.mark_ack_published(conn, view.alert_id, now)
            announced.append(alert)
        return announced

    # -- one (edge, model): read, judge, then one short write

    def _judge(
        self,
        edge: str,
        model: str,
        counts: dict[tuple[str, str], tuple[int, int]],
        relabels: int,
        now: float,
    ) -> list[Alert]:
        judgement = self._read(edge, model, counts, relabels, now)
        if judgement is None:
            return []
        with self.store.transaction() as conn:
            if judgement.record_estimate:
                # Estimates are recorded per window, windows not overlapping (one row per
                # `min_window` predictions); alerts follow the sliding window.
                alert_store.write_estimate(conn, edge, model, judgement.result)
            if judgement.new_reference is not None:
                monitor_store.save_drift_reference(conn, edge, model, judgement.new_reference, now)
            views = self._apply(conn, edge, model, judgement.findings, now)
            # Built before the commit: an alert that cannot be announced is not stored.
            alerts = [view.message(self.fleet) for view in views]
        self._seen[(edge, model)] = judgement.key
        self.judged[(edge, model)] = judgement.result.window_end
        return alerts

    def _read(
        self,
        edge: str,
        model: str,
        counts: dict[tuple[str, str], tuple[int, int]],
        relabels: int,
        now: float,
    ) -> _Judgement | None:
        window = self.policy.min_window
        model_evals = sum(n for (m, _), (n, _) in counts.items() if m == model)
        edge_evals = counts.get((model, edge), (0, 0))[1]
        newest_rid = monitor_store.newest_prediction(self.store, edge)
        key = (newest_rid, model_evals, edge_evals, relabels)
        if self._seen.get((edge, model)) == key:
            return None
        newest = self.windows.newest(edge, model)
        if len(newest) < window:
            self._seen[(edge, model)] = key  # not a full window yet: nothing to judge
            return None
        oldest_first = list(reversed(newest))
        current = [row(r) for r in oldest_first]
        predictor = self.windows.predictor(model, (model_evals, relabels), now)
        result = estimate(current, predictor)
        record = result.window_start > alert_store.last_estimate_end(self.store, edge, model)
        reference, new_reference = self.windows.reference(edge, model, edge_evals)
        # Against its first predictions, an edge's window is judged once it is past them.
        drift_current = [
            row
            for row, record_ in zip(current, oldest_first, strict=True)
            if record_.rid > reference.last_rowid
        ]
        drift = drift_findings(
            reference.columns,
            drift_current,
            self.policy.drift,
            reference_source=reference.source,
        )
        # The window's trend figures beside its estimate (the console draws them).
        result = replace(
            result,
            rejects=sum(r.decision == "reject" for r in newest),
            input_drift=_judged(drift, AlertKind.INPUT_DRIFT),
            score_drift=_judged(drift, AlertKind.SCORE_DRIFT),
        )
        findings = [
            *self._off_delayed(
                edge,
                model,
                drift,
                [r.rid for r in newest],
            ),
            accuracy_finding(
                result, self.policy.min_estimated_accuracy, self.policy.accuracy_clear_margin
            ),
            # Issue 28: novel parts (PredictionRecord.novel), graded by how far over the
            # threshold they scored, by CUSUM.
            novel_finding(
                [
                    grade(r.novel, r.anomaly_score, r.anomaly_threshold, self.policy.novel)
                    for r in oldest_first
                ],
                self.policy.novel,
            ),
        ]
        return _Judgement(key, result, record, findings, new_reference)

    def _off_delayed(
        self, edge: str, model: str, findings: list[Finding], rowids: list[int]
    ) -> list[Finding]:
        """Drift may clear only after a whole window in which it did not hold
        (alert_rules.with_off_delay); first seen after a restart, it waits one window."""
        newest = max(rowids)
        delayed = []
        for finding in findings:
            key = (edge, model, finding.kind)
            if finding.holds:
                self._held[key] = newest
            held = self._held.setdefault(key, newest)
            fresh = sum(1 for rowid in rowids if rowid > held)
            delayed.append(with_off_delay(finding, fresh, self.policy.min_window))
        return delayed

    def _apply(
        self,
        conn: Transaction,
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

    def _clear(self, conn: Transaction, action: Clear, now: float) -> list[AlertView]:
        if not alert_store.clear_alert(conn, action.alert_id, now):
            return []
        view = alert_store.get_alert(self.store, action.alert_id)
        log.info("alert %s cleared: %s on %s", view.alert_id, view.kind, view.edge)
        if action.finding is not None:
            view = replace(view, value=action.finding.value)
        return [view]

    def _clear_unserved(
        self, conn: Transaction, unserved: list[OpenAlert], now: float
    ) -> list[AlertView]:
        """Alerts of a model an edge no longer serves: nothing watches them, so they close."""
        events: list[AlertView] = []
        for alert in unserved:
            events += self._clear(conn, Clear(alert.alert_id, alert.kind, None), now)
        return events


def _judged(findings: list[Finding], kind: AlertKind) -> float | None:
    """The drift value (largest PSI) of ``kind`` among ``findings``; None: not judged."""
    for finding in findings:
        if finding.kind is kind and finding.holds is not None:
            return finding.value
    return None

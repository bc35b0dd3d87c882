"""The monitor's reads: evaluation counts, the drift reference and the MPP predictor.

:mod:`fedge.edge_manager.monitor.tick` asks these per tick, outside any write transaction;
they go through indexes (``predictions_edge``, ``evaluations_counts``) and never walk a
table whose size grows with traffic.

**The MPP fit** uses the manager's current labels (``labels``, joined on the held-out
image's prediction id, a re-lit copy's ``~k`` suffix stripped), not the label a station
reported with its evaluation: an operator's relabel at the manager corrects the fit (it
is refitted on the next relabel or evaluation). Rows without a manager label are left out.

**References, and what they are not.** A prediction reference (no gate evaluation on that
edge) is persisted with its rows in ``drift_references``, so a restarted monitor compares
against the same window even after retention pruned it (not the oldest retained rows,
which may be the drifted period). The
gate's held-out set as a reference can differ from ordinary traffic: operators label the
images they were shown, often the flagged ones, so the held-out set over-represents
defects and low-confidence images. Input statistics are the least affected; *score*
drift is the most (a reference rich in uncertain scores makes ordinary confident traffic
look drifted, or hides real score drift), so read a score-drift alert against a gate
reference with that in mind.

The statements are :mod:`fedge.edge_manager.monitor.store`'s.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fedge.edge_manager.monitor import store as monitor_store
from fedge.edge_manager.monitor.rules import (
    Columns,
    MonitorPolicy,
    WindowRow,
    columns,
    mpp_training_set,
)
from fedge.edge_manager.monitor.store import WindowRecord
from fedge.edge_manager.store import Store
from fedge.monitoring.mpp import MppPredictor

log = logging.getLogger(__name__)

SCAN_WINDOWS = 10
"""How many windows of an edge's newest predictions the current window is looked for in."""


@dataclass(frozen=True)
class Reference:
    rows: tuple[WindowRow, ...]
    source: str  # "settled", "evaluations" or "predictions"; "settling": none yet
    last_rowid: int  # predictions after it are the current window's (0 for evaluations)
    n_evaluations: int = 0  # the evaluation rows it was read from
    settled_after: float | None = None  # "settled": the probation pass it follows

    @cached_property
    def columns(self) -> Columns:
        """Computed once per reference, not per tick (a gate reference is large)."""
        return columns(self.rows)


@dataclass(frozen=True)
class _Fitted:
    key: tuple[int, int]  # (evaluation rows, newest relabel) it was fitted for
    predictor: MppPredictor | None


def _json_map(text: object) -> dict[str, float] | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def row(record: WindowRecord) -> WindowRow:
    return WindowRow(
        scores=_json_map(record.scores) or {},
        stats=_json_map(record.stats),
        at=record.at,
        label=record.label,
    )


def _stored_rows(text: str) -> tuple[list[Any], float | None]:
    """A persisted reference's rows, and the pass it follows (None: a first-predictions
    reference, stored as a bare list before references were re-based per deployment)."""
    value = json.loads(text)
    if isinstance(value, dict):
        return list(value["rows"]), float(value["settled_after"])
    return list(value), None


def _kept(stored: Any) -> WindowRecord:
    """A row of a persisted reference (:meth:`Windows.reference` writes them)."""
    label = stored.get("label")
    return WindowRecord(
        stored["scores"],
        stored["stats"],
        float(stored["at"]),
        None if label is None else str(label),
    )


class Windows:
    """The reads of one monitor, with what it caches between ticks."""

    def __init__(self, store: Store, policy: MonitorPolicy) -> None:
        self.store = store
        self.policy = policy
        self._references: dict[tuple[str, str], Reference] = {}
        self._fitted: dict[str, _Fitted] = {}
        monitor_store.create_evaluation_counts_index(store)

    def newest(self, edge: str, model: str) -> list[WindowRecord]:
        """The current window, newest first (fewer rows: not a full window yet)."""
        window = self.policy.min_window
        return monitor_store.newest_predictions(
            self.store, edge, model, SCAN_WINDOWS * window, window
        )

    def evaluation_counts(self, models: set[str]) -> dict[tuple[str, str], tuple[int, int]]:
        """Per (model, edge) of the served models: all evaluation rows (the MPP fit's) and
        those of images as they are (the reference's). One grouped count per tick, read
        from the ``evaluations_counts`` index alone."""
        return monitor_store.evaluation_counts(self.store, models)

    def reference(
        self, edge: str, model: str, edge_evals: int
    ) -> tuple[Reference, tuple[int, int, str] | None]:
        """The pair's reference, and a new prediction reference to store: its first and
        last rowid and its rows as JSON (``drift_references``).

        Issue 28 item 5: a deployment's reference follows the model. Once the edge reported
        the model's deployment passed its probation there, the model's first window of
        predictions received since that deployment began there -- the images its
        probation proved it on, then those after the pass if they were fewer -- is its
        reference at that edge; never again the gate's held-out set, which after a retrain
        on a new condition mixes the old and new conditions and so keeps drift alerts open
        against the very traffic the model was trained and proven for (and a
        drift-triggered loop retraining on them). During probation drift is judged as
        before (a rollout's ``alerts`` criterion reads it); after the pass, until that
        window is full, it is not judged. A model whose deployment is not known at the
        edge (served before deployments were recorded) keeps the gate's or its first
        predictions' reference."""
        deployed = monitor_store.deployed(self.store, edge, model)
        if deployed is not None and deployed.passed_at is not None:
            return self._settled(edge, model, deployed, deployed.passed_at)
        kept = self._stored(edge, model)
        if kept is not None and kept.source == "settled":
            return kept, None  # its deployment's events were pruned; its reference stays
        window = self.policy.min_window
        cached = self._references.get((edge, model))
        if edge_evals >= window:
            if (
                cached is not None
                and cached.source == "evaluations"
                and (cached.n_evaluations == edge_evals)
            ):
                return cached, None
            rows = monitor_store.evaluation_reference(self.store, edge, model)
            if len(rows) >= window:
                cached = Reference(tuple(row(r) for r in rows), "evaluations", 0, edge_evals)
                self._references[(edge, model)] = cached
                return cached, None
        if kept is not None:
            return kept, None
        records = monitor_store.first_predictions(self.store, edge, model, window)
        reference = Reference(
            tuple(row(r) for r in records),
            "predictions",
            records[-1].rid if records else 0,
        )
        if len(records) < window:
            return reference, None
        self._references[(edge, model)] = reference  # the first window never changes
        kept_rows = [{"scores": r.scores, "stats": r.stats, "at": r.at} for r in records]
        return reference, (records[0].rid, reference.last_rowid, json.dumps(kept_rows))

    def _settled(
        self, edge: str, model: str, deployed: monitor_store.Deployed, passed_at: float
    ) -> tuple[Reference, tuple[int, int, str] | None]:
        """The reference of a deployment that passed its probation (see :meth:`reference`)."""
        kept = self._stored(edge, model)
        if kept is not None and kept.settled_after == passed_at:
            return kept, None
        window = self.policy.min_window
        records = monitor_store.settled_predictions(
            self.store, edge, model, deployed.first_at, SCAN_WINDOWS * window, window
        )
        if len(records) < window:
            return Reference((), "settling", 0), None
        reference = Reference(
            tuple(row(r) for r in records),
            "settled",
            records[-1].rid,
            settled_after=passed_at,
        )
        self._references[(edge, model)] = reference
        kept_rows = [{"scores": r.scores, "stats": r.stats, "at": r.at} for r in records]
        text = json.dumps(
            {
                "settled_after": passed_at,
                "deployment": deployed.deployment_id,
                "rows": kept_rows,
            }
        )
        return reference, (records[0].rid, reference.last_rowid, text)

    def _stored(self, edge: str, model: str) -> Reference | None:
        """The pair's persisted prediction reference (cached), if any and usable."""
        cached = self._references.get((edge, model))
        if cached is not None and cached.source in ("predictions", "settled"):
            return cached
        stored = monitor_store.drift_reference(self.store, edge, model)
        if stored is None:
            return None
        try:
            rows, settled_after = _stored_rows(stored.rows)
            kept_rows = tuple(row(_kept(r)) for r in rows)
        except (ValueError, TypeError, KeyError, AttributeError):
            kept_rows, settled_after = (), None
        if len(kept_rows) < self.policy.min_window:
            log.warning("the stored drift reference of %s on %s is unusable", model, edge)
            return None
        source = "predictions" if settled_after is None else "settled"
        reference = Reference(kept_rows, source, stored.last_rowid, settled_after=settled_after)
        self._references[(edge, model)] = reference
        return reference

    def predictor(self, model: str, key: tuple[int, int], now: float) -> MppPredictor | None:
        """The model's MPP predictor, fitted once per set of evaluation rows and relabels,
        and stored (a restarted monitor reloads it if the evaluation rows are the same)."""
        n_rows = key[0]
        fitted = self._fitted.get(model)
        if fitted is not None and fitted.key == key:
            return fitted.predictor
        predictor: MppPredictor | None = None
        stored = monitor_store.stored_predictor(self.store, model)
        if fitted is None and stored is not None and stored.n_rows == n_rows:
            try:
                predictor = MppPredictor.from_json(stored.predictor)
            except Exception as exc:  # any stored text: refit rather than stop watching
                log.warning("stored MPP predictor of %s is unusable (%s); refitting", model, exc)
        if predictor is None and n_rows > 0:
            predictor = self._fit(model, n_rows, now)
        self._fitted[model] = _Fitted(key, predictor)
        return predictor

    def _fit(self, model: str, n_rows: int, now: float) -> MppPredictor | None:
        # Every row, re-lit copies included (same label as their image): outside the
        # held-out lighting a predictor fitted on in-distribution rows only extrapolates
        # (Guillory et al., ICCV'21; `fedge bench mpp`, mpp vs mpp_plain).
        rows = monitor_store.fit_rows(self.store, model)
        features, correct = mpp_training_set([row(r) for r in rows])
        try:
            predictor = MppPredictor.fit(features, correct)
        except ValueError as exc:
            log.info("no MPP predictor for %s yet: %s", model, exc)
            return None
        with self.store.transaction() as conn:
            monitor_store.save_predictor(
                conn, model, predictor.to_json(), n_rows, predictor.fit_accuracy, now
            )
        log.info(
            "fitted the MPP predictor of %s on %d labelled evaluation rows (accuracy %.3f)",
            model,
            len(features),
            predictor.fit_accuracy,
        )
        return predictor

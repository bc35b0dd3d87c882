"""Evaluation reports at the manager: stored once; bad, forged or oversized ones rejected,
counted and changing nothing; and the gate's refusals before anything is started."""

import dataclasses
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FLEET, FleetHome, make_fleet_home, publish_model

from fedge.edge_manager.errors import ManagerError, UnknownModelError
from fedge.edge_manager.gate import reports as evaluations
from fedge.edge_manager.gate import run as gating
from fedge.edge_manager.gate.verdict import GatePolicy
from fedge.edge_manager.ingest.messages import Ingestor, Outcome, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.edge_manager.store import Store
from fedge.protocols import codec, topics
from fedge.protocols.evaluation import (
    EvaluationItem,
    EvaluationReport,
    EvaluationRequest,
    EvaluationStatus,
)

EDGE = "st-01"


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fh = make_fleet_home(tmp_path)
    publish_model(fh, 1, seed=1)
    publish_model(fh, 2, seed=2)
    with fh.fleet() as fleet:
        for i, edge in enumerate(("st-01", "st-02", "st-01")):
            fleet.store.conn.execute(
                "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
                "threshold, config_version, latency_ms, source) "
                "VALUES (?, ?, 0, ?, 'inspect:1', '{}', 'accept', 0.5, 1, 1.0, 'api')",
                (f"p-{i}", edge, time.time()),
            )
        fleet.add_label("p-0", "scratch", "qa")
        fleet.add_label("p-2", "clean", "qa")
        fleet.store.conn.execute("UPDATE edges SET serving='inspect:1' WHERE edge=?", (EDGE,))
    yield fh
    fh.close()


def _report(request: gating.GateRequest, **changes: object) -> EvaluationReport:
    items = tuple(
        EvaluationItem(pid, model, label, {"clean": 0.3, "scratch": 0.7}, {"mean": 0.5})
        for pid, label in (("p-0", "scratch"), ("p-2", "clean"))
        for model in ("inspect:1", "inspect:2")
    )
    report = EvaluationReport(EDGE, request.eval_id, 1, EvaluationStatus.DONE, "", 2, items, 1.0)
    return dataclasses.replace(report, **changes)  # type: ignore[arg-type]


def _ingest(fh: FleetHome, payload: bytes, edge: str = EDGE) -> Outcome:
    topic = topics.up(FLEET, edge, topics.Up.EVALUATE)
    with fh.fleet() as fleet, IngestTransaction.open(fleet.store) as tx:
        return Ingestor(fleet.store, FLEET).handle(tx, topic, payload, time.time())


def _counts(fh: FleetHome) -> tuple[int, int, int]:
    return (
        int(fh.db.scalar("SELECT count(*) FROM evaluation_reports")),
        int(fh.db.scalar("SELECT count(*) FROM evaluations")),
        int(fh.db.scalar("SELECT count(*) FROM rejections")),
    )


def test_a_report_is_stored_once_and_bad_ones_change_nothing(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        request = gating.start(fleet, "inspect:2", [EDGE])
    assert request.serving == {EDGE: "inspect:1"}
    good = _report(request)
    bad: dict[str, bytes] = {
        "unknown evaluation": codec.encode(_report(request, eval_id="ev-forged")),
        "unknown version": codec.encode(_report(request, version=7)),
        "a model not asked for": codec.encode(
            _report(request, items=(dataclasses.replace(good.items[0], model="inspect:9"),))
        ),
        "another edge's name": codec.encode(_report(request, edge="st-02")),
        "malformed": b'{"schema":1,"kind":"evaluation_report"',
        "oversized": codec.encode(good) + b" " * (300 * 1024),
        "invalid": codec.encode(good).replace(b'"done"', b'"maybe"'),
    }
    for what, payload in bad.items():
        outcome = _ingest(fh, payload)
        assert outcome.verdict is Verdict.REJECTED, what
    assert _counts(fh) == (0, 0, len(bad))
    rejected = fh.db.query("SELECT reason, detail FROM rejections ORDER BY rowid")
    assert [r["reason"] for r in rejected][-2:] == ["oversized", "malformed"]
    details = " | ".join(r["detail"] for r in rejected)
    for said in ("did not ask it for", "not of the models asked", "came from 'st-01'"):
        assert said in details, details

    assert _ingest(fh, codec.encode(good)).verdict is Verdict.STORED
    assert _ingest(fh, codec.encode(good)).verdict is Verdict.DUPLICATE  # retained again
    assert _counts(fh) == (1, 4, len(bad))
    row = fh.row("SELECT * FROM evaluations WHERE prediction_id='p-0' AND model='inspect:2'")
    assert row["stats"] == '{"mean": 0.5}' and row["label"] == "scratch"
    state = gating.progress(fh.db, request)
    assert state.done and state.answered[EDGE].items == 4


def test_a_report_over_grpc_is_stored_like_one_over_mqtt(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        request = gating.start(fleet, "inspect:2", [EDGE])
        with IngestTransaction.open(fleet.store) as tx:
            outcome = Ingestor(fleet.store, FLEET).handle_status(
                tx, EDGE, topics.Up.EVALUATE, codec.encode(_report(request)), time.time()
            )
    assert outcome.verdict is Verdict.STORED


def _bless(fh: FleetHome, ref: str) -> None:
    name, version = ref.split(":")
    fh.db.conn.execute(
        "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
        "VALUES (?, ?, 1, '{}', 'ev-earlier', 1.0)",
        (name, int(version)),
    )


def _evaluate_rows(fh: FleetHome) -> int:
    return int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='evaluate'"))


def test_a_pending_evaluation_refuses_a_second_gate_until_it_is_abandoned(
    fh: FleetHome,
) -> None:
    _bless(fh, "inspect:2")
    with fh.fleet() as fleet:
        first = gating.start(fleet, "inspect:2", [EDGE])
        with pytest.raises(ManagerError, match=rf"{first.eval_id} of inspect:2.*nothing was"):
            gating.start(fleet, "inspect:2", [EDGE])
        assert _evaluate_rows(fh) == 1
        # Past its timeout, unanswered and undecided: abandoned, and the new gate says so.
        later = first.started_at + gating.DEFAULT_TIMEOUT_S + 1
        second = gating.start(fleet, "inspect:2", [EDGE], now=later)
        assert second.abandoned == {EDGE: first.eval_id}
        state = gating.progress(fleet.store, first)
        assert state.superseded == {EDGE: second.eval_id} and state.done
        # Every station superseded: no verdict, nothing recorded, the blessing stands.
        with pytest.raises(
            gating.NoVerdictError, match=f"superseded by evaluation {second.eval_id}"
        ):
            gating.decide(fleet, first, GatePolicy(min_examples=1))
        stored = gating.stored(fh.db, "inspect", 2)
        assert stored is not None and stored.blessed and stored.eval_id == "ev-earlier"
        assert _ingest(fh, codec.encode(_report(second, version=2))).verdict is Verdict.STORED
        gating.decide(fleet, second, GatePolicy(min_examples=1), now=later + 5)
    stored = gating.stored(fh.db, "inspect", 2)
    assert stored is not None and stored.eval_id == second.eval_id
    assert stored.evidence["abandoned"] == {EDGE: first.eval_id}
    # An answered (or decided) evaluation is not pending: the next gate starts at once.
    with fh.fleet() as fleet:
        gating.start(fleet, "inspect:2", [EDGE])


def test_no_answer_from_any_station_records_no_verdict(fh: FleetHome) -> None:
    _bless(fh, "inspect:2")
    with fh.fleet() as fleet:
        request = gating.start(fleet, "inspect:2", [EDGE])
        with pytest.raises(gating.NoVerdictError, match=f"{EDGE} \\(did not answer\\)"):
            gating.decide(fleet, request, GatePolicy(min_examples=1))
    assert fh.db.scalar("SELECT count(*) FROM gate_results") == 1
    stored = gating.stored(fh.db, "inspect", 2)
    assert stored is not None and stored.blessed


def test_edges_serving_the_candidate_are_left_out_or_the_gate_is_refused(
    fh: FleetHome,
) -> None:
    _bless(fh, "inspect:2")
    with fh.fleet() as fleet:
        fleet.store.conn.execute("UPDATE edges SET serving='inspect:2' WHERE edge=?", (EDGE,))
        with pytest.raises(
            ManagerError, match=r"st-01 serves the candidate already .*stands \(blessed\)"
        ):
            gating.start(fleet, "inspect:2", [EDGE])
        with pytest.raises(ManagerError, match="serves the candidate already"):
            gating.start(fleet, "inspect:2")  # st-02 has no labels: st-01 is the only one
        assert _evaluate_rows(fh) == 0
        fleet.add_label("p-1", "scratch", "qa")  # st-02's prediction; it serves nothing
        request = gating.start(fleet, "inspect:2")
        assert request.serving == {"st-02": None}
        assert request.left_out == {EDGE: gating.SERVES_CANDIDATE}
        items = (EvaluationItem("p-1", "inspect:2", "scratch", {"clean": 0.3, "scratch": 0.7}),)
        report = EvaluationReport("st-02", request.eval_id, 1, EvaluationStatus.DONE, "", 1, items)
        assert _ingest(fh, codec.encode(report), "st-02").verdict is Verdict.STORED
        verdict = gating.decide(fleet, request, GatePolicy(min_examples=1))
    left = {s.edge: s for s in verdict.stations}[EDGE]
    assert (left.status, left.passed, left.examples) == ("left_out", None, 0)
    assert left.reason == "serves the candidate already: not used"
    stored = gating.stored(fh.db, "inspect", 2)
    assert stored is not None and stored.evidence["left_out"] == {EDGE: gating.SERVES_CANDIDATE}


def test_foreign_and_misclassed_items_are_dropped_not_the_report(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        fleet.add_label("p-1", "scratch", "qa")  # st-02's: never judges st-01's report
        request = gating.start(fleet, "inspect:2", [EDGE])
        good = _report(request)
        foreign = tuple(dataclasses.replace(i, prediction_id="p-1") for i in good.items[:2])
        misclassed = dataclasses.replace(
            good.items[0], prediction_id="p-9", scores={"clean": 0.3, "dent": 0.7}
        )
        report = _report(request, items=(*good.items, *foreign, misclassed))
        assert _ingest(fh, codec.encode(report)).verdict is Verdict.STORED
        assert fh.db.scalar("SELECT count(*) FROM evaluations") == 4
        assert fh.db.scalar("SELECT count(*) FROM rejections") == 0
        verdict = gating.decide(fleet, request, GatePolicy(min_examples=1))
    (station,) = verdict.stations
    assert (station.status, station.examples) == ("done", 2)
    assert (station.foreign_items, station.rejected_items) == (2, 1)
    assert "1 item(s) with scores not of the model's classes" in station.dropped_reason
    assert "2 item(s) on other stations' predictions (p-1)" in station.dropped_reason
    stored = gating.stored(fh.db, "inspect", 2)
    assert stored is not None
    assert stored.evidence["stations"][0]["foreign_items"] == 2


def test_the_managers_labels_of_a_station_are_its_own_predictions_only(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        fleet.add_label("p-1", "clean", "qa")  # st-02's prediction
        assert evaluations.manager_labels(fleet.store, EDGE, {"p-0", "p-1"}) == {"p-0": "scratch"}
        assert evaluations.manager_labels(fleet.store, "st-02", {"p-0", "p-1"}) == {"p-1": "clean"}


def test_the_gate_refuses_bad_input_and_starts_nothing(fh: FleetHome) -> None:
    def evaluate_rows() -> int:
        return int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='evaluate'"))

    with fh.fleet() as fleet:
        with pytest.raises(UnknownModelError, match="inspect:9 is not in the registry"):
            gating.start(fleet, "inspect:9")
        with pytest.raises(ManagerError, match="st-02 has no labelled predictions"):
            gating.start(fleet, "inspect:2", ["st-01", "st-02"])
        with pytest.raises(ManagerError, match="unknown edge"):
            gating.start(fleet, "inspect:2", ["st-09"])
        fleet.registry.publish(
            fleet.registry.get("inspect", 1).path, name="inspect", version=3,
            classes=("clean", "dent"),
        )  # fmt: skip
        with pytest.raises(ManagerError, match="st-01 serves inspect:1 with clean,scratch"):
            gating.start(fleet, "inspect:3")
        fleet.store.conn.execute("UPDATE edges SET serving='other:4' WHERE edge=?", (EDGE,))
        with pytest.raises(ManagerError, match="not in this registry"):
            gating.start(fleet, "inspect:2")
        fleet.store.conn.execute("DELETE FROM labels")
        with pytest.raises(ManagerError, match="no edge has labelled predictions"):
            gating.start(fleet, "inspect:2")
    assert evaluate_rows() == 0


def test_re_lit_copies_are_stored_apart_and_the_gate_ignores_them(fh: FleetHome) -> None:
    """The station's images as they are: the candidate (inspect:2) right on both, the
    serving model on one; its re-lit copies: the candidate always wrong, the serving
    model always right -- enough to fail the candidate if the gate counted them."""
    right = {"p-0": {"clean": 0.3, "scratch": 0.7}, "p-2": {"clean": 0.8, "scratch": 0.2}}
    wrong = {"p-0": right["p-2"], "p-2": right["p-0"]}
    labels = {"p-0": "scratch", "p-2": "clean"}
    items = []
    for pid, label in labels.items():
        serving_scores = right[pid] if pid == "p-0" else wrong[pid]
        items += [
            EvaluationItem(pid, "inspect:2", label, right[pid], {"mean": 0.5}),
            EvaluationItem(pid, "inspect:1", label, serving_scores, {"mean": 0.5}),
        ]
        for copy in (1, 2):
            items += [
                EvaluationItem(pid, "inspect:2", label, wrong[pid], {"mean": 0.9}, copy),
                EvaluationItem(pid, "inspect:1", label, right[pid], {"mean": 0.9}, copy),
            ]
    with fh.fleet() as fleet:
        request = gating.start(fleet, "inspect:2", [EDGE], augment=2)
        assert b'"augment":2' in codec.encode(
            codec.decode(
                str(fh.db.scalar("SELECT document FROM desired WHERE kind='evaluate'")).encode(),
                EvaluationRequest,
            )
        )
        report = _report(request, items=tuple(items))
        assert _ingest(fh, codec.encode(report)).verdict is Verdict.STORED
        stored = fh.db.query(
            "SELECT prediction_id, augmented, label FROM evaluations WHERE model='inspect:2' "
            "ORDER BY prediction_id"
        )
        assert [(r["prediction_id"], r["augmented"], r["label"]) for r in stored] == [
            ("p-0", 0, "scratch"), ("p-0~1", 1, "scratch"), ("p-0~2", 2, "scratch"),
            ("p-2", 0, "clean"), ("p-2~1", 1, "clean"), ("p-2~2", 2, "clean"),
        ]  # fmt: skip
        verdict = gating.decide(fleet, request, GatePolicy(min_examples=1))
    assert verdict.blessed, verdict.reason
    (station,) = verdict.stations
    assert (station.examples, station.candidate_accuracy, station.serving_accuracy) == (2, 1, 0.5)
    assert station.unlabelled == 0  # the copies were not read as images without a label


def test_a_store_from_before_re_lit_copies_gets_the_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE evaluations (eval_id TEXT NOT NULL, edge TEXT NOT NULL, "
        "prediction_id TEXT NOT NULL, model TEXT NOT NULL, label TEXT NOT NULL, "
        "scores TEXT NOT NULL, stats TEXT NOT NULL, at REAL NOT NULL, "
        "PRIMARY KEY (eval_id, edge, prediction_id, model))"
    )
    old.execute(
        "INSERT INTO evaluations VALUES ('e', 'st-01', 'p-0', 'm:1', 'clean', '{}', '{}', 1)"
    )
    old.commit()
    old.close()
    store = Store(path)
    try:
        assert store.query("SELECT prediction_id, augmented FROM evaluations") == [
            {"prediction_id": "p-0", "augmented": 0}
        ]
    finally:
        store.close()

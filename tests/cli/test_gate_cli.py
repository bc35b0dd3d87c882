"""``fedge model gate``: bad input is a clear error and starts nothing; --show prints the
stored evidence. (The evaluation itself, with real stations: tests/test_gate_flow.py.)"""

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FleetHome, make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.gate import reports as evaluations
from fedge.edge_manager.gate import run as gating
from fedge.edge_manager.gate.verdict import GatePolicy, Verdict
from fedge.protocols.evaluation import EvaluationItem, EvaluationReport, EvaluationStatus


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path)
    publish_model(fleet_home, 1, seed=1)
    publish_model(fleet_home, 2, seed=2)
    yield fleet_home
    fleet_home.close()


def fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, result.output


def said(out: str, text: str) -> bool:
    """Whether the output says ``text`` (rich wraps long lines at the terminal width)."""
    return text in " ".join(out.split())


def label_one(fh: FleetHome, edge: str = "st-01", pid: str = "p-1") -> None:
    with fh.fleet() as fleet:
        fleet.store.conn.execute(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
            "threshold, config_version, latency_ms, source) "
            "VALUES (?, ?, 0, ?, 'inspect:1', '{}', 'accept', 0.5, 1, 1.0, 'api')",
            (pid, edge, time.time()),
        )
        fleet.add_label(pid, "scratch", "qa")


def started(fh: FleetHome) -> int:
    return int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='evaluate'"))


def test_bad_input_is_a_clear_error_and_starts_nothing(fh: FleetHome) -> None:
    code, out = fedge(fh, "model", "gate", "inspect:2")
    assert code == 1 and said(out, "no edge has labelled predictions"), out
    label_one(fh)
    code, out = fedge(fh, "model", "gate", "inspect:9")
    assert code == 1 and said(out, "model inspect:9 is not in the registry"), out
    code, out = fedge(fh, "model", "gate", "inspect")
    assert code == 1 and said(out, "NAME:VERSION"), out
    code, out = fedge(fh, "model", "gate", "inspect:2", "--edges", "st-02")
    assert code == 1 and said(out, "st-02 has no labelled predictions"), out
    code, out = fedge(fh, "model", "gate", "inspect:2", "--max-drop", "2")
    assert code == 1 and said(out, "max drop must be in [0, 1]"), out
    with fh.fleet() as fleet:
        fleet.registry.publish(
            fleet.registry.get("inspect", 1).path, name="inspect", version=3,
            classes=("clean", "dent"),
        )  # fmt: skip
        fleet.store.conn.execute("UPDATE edges SET serving='inspect:1' WHERE edge='st-01'")
    code, out = fedge(fh, "model", "gate", "inspect:3")
    assert code == 1 and said(out, "st-01 serves inspect:1 with clean,scratch"), out
    code, out = fedge(fh, "model", "gate", "inspect:2", "--show")
    assert code == 1 and said(out, "inspect:2 has not been gated yet"), out
    assert started(fh) == 0


def answer(fh: FleetHome, request: gating.GateRequest, edge: str, pid: str) -> None:
    """``edge`` answers ``request``: the candidate scores its one held-out image right."""
    scores = {"clean": 0.3, "scratch": 0.7}
    item = EvaluationItem(pid, request.candidate, "scratch", scores)
    report = EvaluationReport(edge, request.eval_id, 1, EvaluationStatus.DONE, "", 1, (item,))
    with fh.fleet() as fleet, fleet.store.transaction() as conn:
        assert evaluations.store_report(conn, edge, report, time.time())


def test_show_prints_the_stored_evidence_without_evaluating(fh: FleetHome) -> None:
    label_one(fh)
    label_one(fh, "st-02", "p-2")
    with fh.fleet() as fleet:
        request = gating.start(fleet, "inspect:2")
        answer(fh, request, "st-01", "p-1")
        gating.decide(fleet, request, GatePolicy())  # st-02 did not answer
    assert started(fh) == 2
    code, out = fedge(fh, "model", "gate", "inspect:2", "--show")
    assert code == 0, out
    assert said(out, "did not answer in time") and said(out, "did not answer: st-02")
    assert said(out, "inspect:2: NOT BLESSED") and said(out, request.eval_id)
    code, out = fedge(fh, "model", "gate", "inspect:2", "--show", "--json")
    evidence = json.loads(out)
    assert evidence["eval_id"] == request.eval_id and evidence["not_answered"] == ["st-02"]
    assert started(fh) == 2  # --show evaluated nothing


def test_a_gate_prints_its_own_verdict_not_a_newer_one(
    fh: FleetHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another gate of the same model stores its verdict while this one decides: the
    command shows (and exits on) the verdict of its own evaluation."""
    label_one(fh)
    real_run = gating.run

    def run_beside_another(
        fleet: Fleet, candidate: str, policy: GatePolicy, **kwargs: Any
    ) -> tuple[gating.GateRequest, Verdict]:
        request = gating.start(fleet, candidate, kwargs.get("edges"))
        answer(fh, request, "st-01", "p-1")
        verdict = gating.decide(fleet, request, policy, now=time.time())
        fleet.store.conn.execute(
            "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
            "VALUES ('inspect', 2, 1, ?, 'ev-other', ?)",
            (json.dumps({**verdict.evidence(), "eval_id": "ev-other"}), time.time() + 60),
        )
        return request, verdict

    monkeypatch.setattr(gating, "run", run_beside_another)
    code, out = fedge(fh, "model", "gate", "inspect:2", "--min-examples", "5")
    monkeypatch.setattr(gating, "run", real_run)
    assert code == 1, out
    (mine,) = fh.db.query("SELECT eval_id FROM gate_results WHERE eval_id != 'ev-other'")
    assert said(out, f"evaluation {mine['eval_id']}") and not said(out, "ev-other"), out
    assert said(out, "too few examples (1 < 5)")

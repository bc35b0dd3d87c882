"""``fedge model gate``: bad input is a clear error and starts nothing; --show prints the
stored evidence. (The evaluation itself, with real stations: tests/test_gate_flow.py.)"""

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager import gating
from fedge.edge_manager.gate import GatePolicy


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


def label_one(fh: FleetHome, edge: str = "st-01") -> None:
    with fh.fleet() as fleet:
        fleet.store.conn.execute(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
            "threshold, config_version, latency_ms, source) "
            "VALUES ('p-1', ?, 0, ?, 'inspect:1', '{}', 'accept', 0.5, 1, 1.0, 'api')",
            (edge, time.time()),
        )
        fleet.add_label("p-1", "scratch", "qa")


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


def test_show_prints_the_stored_evidence_without_evaluating(fh: FleetHome) -> None:
    label_one(fh)
    with fh.fleet() as fleet:
        request = gating.start(fleet, "inspect:2")
        gating.decide(fleet, request, GatePolicy())  # nobody answered
    assert started(fh) == 1
    code, out = fedge(fh, "model", "gate", "inspect:2", "--show")
    assert code == 0, out
    assert said(out, "did not answer in time") and said(out, "did not answer: st-01")
    assert said(out, "inspect:2: NOT BLESSED") and said(out, request.eval_id)
    code, out = fedge(fh, "model", "gate", "inspect:2", "--show", "--json")
    evidence = json.loads(out)
    assert evidence["eval_id"] == request.eval_id and evidence["not_answered"] == ["st-01"]
    assert started(fh) == 1  # --show evaluated nothing

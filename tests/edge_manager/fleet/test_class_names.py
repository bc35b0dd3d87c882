"""Class names are checked where they enter: publish, thresholds, labels (issue 15)."""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, build_onnx_model, make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.fleet.class_names import class_count_problem, suggestion, unknown_class
from fedge.protocols.manifest import TensorSpec

EDGE = "st-01"


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE,))
    yield fleet_home
    fleet_home.close()


def _fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, " ".join(result.output.split())


def test_class_count_against_the_output_shape() -> None:
    outputs = (TensorSpec("probs", "float32", ("batch", 2)),)
    assert class_count_problem(outputs, ("clean", "scratch")) is None
    problem = class_count_problem(outputs, ("ok", "dent", "scratch"))
    assert problem is not None and "scores 2 classes" in problem and "give exactly 2" in problem
    assert class_count_problem(outputs, ("a", "a")) == "class names must differ; a given twice"
    dynamic = (TensorSpec("probs", "float32", ("batch", "classes")),)
    assert class_count_problem(dynamic, ("a", "b", "c")) is None  # nothing to check against


def test_near_misses_get_a_suggestion_and_case_counts() -> None:
    known = ("clean", "scratch")
    assert suggestion("scrach", known) == " (did you mean 'scratch'?)"
    assert suggestion("Scratch", known) == " (did you mean 'scratch'?)"
    assert suggestion("dent", known) == ""
    assert unknown_class("scratch", known, "a class") is None
    refusal = unknown_class("Scratch", known, "a class")
    assert refusal is not None and refusal.startswith("'Scratch' is not a class")


def test_publish_refuses_more_class_names_than_outputs(fh: FleetHome) -> None:
    model = build_onnx_model(fh.root / "two.onnx", n_outputs=2)
    code, output = _fedge(
        fh, "model", "publish", str(model), "--name", "inspect", "--version", "1",
        "--classes", "ok,dent,scratch",
    )  # fmt: skip
    assert code == 1, output
    assert "scores 2 classes" in output and "3 names were given" in output
    with fh.fleet() as fleet:
        assert fleet.registry.list() == []


def test_a_misspelled_threshold_class_is_refused_with_a_suggestion(fh: FleetHome) -> None:
    publish_model(fh, 1)
    code, output = _fedge(fh, "edge", "set-threshold", EDGE, "0.6", "--class", "scrach")
    assert code == 1, output
    assert "did you mean 'scratch'?" in output and "nothing was changed" in output


def _prediction(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        fleet.store.conn.execute(
            "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, "
            "decision, threshold, config_version, latency_ms, source) "
            "VALUES ('p-1', ?, 0, ?, 'inspect:1', '{}', "
            "'accept', 0.5, 1, 1.0, 'api')",
            (EDGE, time.time()),
        )


@pytest.mark.parametrize(("label", "hint"), [("Scratch", "scratch"), ("dent", None)])
def test_a_label_must_be_a_class_of_the_model(fh: FleetHome, label: str, hint: str | None) -> None:
    publish_model(fh, 1)
    _prediction(fh)
    code, output = _fedge(fh, "labels", "add", "p-1", label)
    assert code == 1, output
    assert f"'{label}' is not a class of inspect:1" in output
    assert ("did you mean" in output) == (hint is not None)
    assert fh.db.scalar("SELECT count(*) FROM labels") == 0
    code, output = _fedge(fh, "labels", "add", "p-1", "scratch")
    assert code == 0, output

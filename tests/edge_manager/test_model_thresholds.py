"""Thresholds tied to a model version, recommended thresholds and a latency budget in the
signed manifest, and an edge's own rollback as the manager shows it (issue "The closed
loop"). Real SQLite, the real CLI (typer's runner), a real signing key."""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, deploy, make_fleet_home, publish_model
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.ingest.messages import Ingestor, Verdict
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.protocols import codec, topics
from fedge.protocols.config import EdgeConfig
from fedge.protocols.deployment import DeployStage, DeployStatus
from fedge.protocols.manifest import ModelManifest, Thresholds
from fedge.protocols.signing import open_signed, trusted

EDGES = ("st-01", "st-02")


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=EDGES)
    publish_model(fleet_home, 1, seed=1)
    publish_model(fleet_home, 2, seed=2)
    yield fleet_home
    fleet_home.close()


def _fedge(fh: FleetHome, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})
    return result.exit_code, " ".join(result.output.split())


def _desired(fh: FleetHome, edge: str) -> EdgeConfig | None:
    with fh.fleet() as fleet:
        return fleet.desired_config(edge)


def _config_count(fh: FleetHome) -> int:
    return int(fh.db.scalar("SELECT count(*) FROM desired WHERE kind='config'"))


# ---------------------------------------------------------------- set-threshold ties


def test_set_threshold_ties_to_the_model_deployed_to_the_edge(fh: FleetHome) -> None:
    deploy(fh, 1, ["st-01"])
    code, output = _fedge(fh, "edge", "set-threshold", "st-01", "0.6")
    assert code == 0, output
    assert "st-01: desired config v1 (threshold 0.6, for inspect:1)" in output
    desired = _desired(fh, "st-01")
    assert desired is not None and (desired.model, desired.default_threshold) == ("inspect:1", 0.6)

    # The newest deployment decides the default tie.
    deploy(fh, 2, ["st-01"])
    code, output = _fedge(fh, "edge", "set-threshold", "st-01", "0.7", "--class", "scratch")
    assert code == 0, output
    desired = _desired(fh, "st-01")
    assert desired is not None
    assert (desired.version, desired.model, desired.class_thresholds) == (
        2,
        "inspect:2",
        {"scratch": 0.7},
    )

    # --model names an earlier one deployed to the edge.
    code, output = _fedge(fh, "edge", "set-threshold", "st-01", "0.65", "--model", "inspect:1")
    assert code == 0, output
    assert "(threshold 0.65, for inspect:1)" in output
    desired = _desired(fh, "st-01")
    assert desired is not None and (desired.version, desired.model) == (3, "inspect:1")

    # Nothing deployed to st-02: the threshold is for any model.
    code, output = _fedge(fh, "edge", "set-threshold", "st-02", "0.5")
    assert code == 0, output
    assert "st-02: desired config v1 (threshold 0.5, for any model: none is deployed)" in output
    assert (desired := _desired(fh, "st-02")) is not None and desired.model is None


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("inspect:9", "model inspect:9 is not in the registry"),
        ("inspect:2", "inspect:2 was never deployed to st-01 (deployed: inspect:1); deploy it"),
        ("inspect", "must look like NAME:VERSION"),
    ],
)
def test_a_model_not_deployed_or_unknown_is_refused(
    fh: FleetHome, model: str, message: str
) -> None:
    deploy(fh, 1, ["st-01"])
    code, output = _fedge(fh, "edge", "set-threshold", "st-01", "0.6", "--model", model)
    assert code == 1, output
    assert message in output
    assert _config_count(fh) == 0


def test_one_bad_edge_of_all_changes_none(fh: FleetHome) -> None:
    deploy(fh, 1, list(EDGES))
    deploy(fh, 2, ["st-01"])
    code, output = _fedge(fh, "edge", "set-threshold", "all", "0.6", "--model", "inspect:2")
    assert code == 1, output
    assert "inspect:2 was never deployed to st-02" in output
    assert _config_count(fh) == 0


def test_a_class_threshold_is_checked_against_the_tied_model(fh: FleetHome, tmp_path: Path) -> None:
    source = publish_model(fh, 3).path
    code, output = _fedge(
        fh, "model", "publish", str(source), "--name", "inspect", "--version", "4",
        "--classes", "clean,dent", "--positive", "dent",
    )  # fmt: skip
    assert code == 0, output
    deploy(fh, 1, ["st-01"])
    deploy(fh, 4, ["st-01"])
    code, output = _fedge(
        fh, "edge", "set-threshold", "st-01", "0.3", "--class", "dent", "--model", "inspect:1"
    )
    assert code == 1, output
    assert "'dent' is not a class of inspect:1" in output
    assert _config_count(fh) == 0
    code, output = _fedge(fh, "edge", "set-threshold", "st-01", "0.3", "--class", "dent")
    assert code == 0, output
    assert (desired := _desired(fh, "st-01")) is not None and desired.model == "inspect:4"


def test_show_names_the_tie_and_where_the_thresholds_come_from(fh: FleetHome) -> None:
    deploy(fh, 1, ["st-01"])
    assert _fedge(fh, "edge", "set-threshold", "st-01", "0.6")[0] == 0
    fh.db.conn.execute("UPDATE edges SET serving='inspect:1' WHERE edge='st-01'")
    code, output = _fedge(fh, "edge", "show", "st-01")
    assert code == 0, output
    assert "(threshold 0.6, per class none) for inspect:1 / reported v0" in output
    assert "thresholds the desired config's" in output
    # The edge moved to inspect:2, which recommends nothing: the config applies untied.
    fh.db.conn.execute("UPDATE edges SET serving='inspect:2' WHERE edge='st-01'")
    code, output = _fedge(fh, "edge", "show", "st-01")
    assert "set for another model (the serving one recommends none)" in output
    with fh.fleet() as fleet:
        view = fleet.show("st-01")
    assert (view.thresholds_for, view.thresholds_source) == ("inspect:1", "untied")


# ---------------------------------------------------------------- publish


def test_publish_stores_recommended_thresholds_and_a_budget_in_the_signed_manifest(
    fh: FleetHome,
) -> None:
    source = publish_model(fh, 3).path
    code, output = _fedge(
        fh, "model", "publish", str(source), "--name", "inspect", "--version", "5",
        "--classes", "clean,scratch", "--positive", "scratch", "--threshold", "0.4",
        "--class-threshold", "scratch=0.3", "--latency-budget-ms", "50",
    )  # fmt: skip
    assert code == 0, output
    with fh.fleet() as fleet:
        published = fleet.registry.get("inspect", 5)
    signed = open_signed(published.envelope, ModelManifest, trusted(fh.home.signing_key().public))
    assert signed.thresholds == Thresholds(0.4, {"scratch": 0.3})
    assert signed.latency_budget_ms == 50.0
    assert published.manifest == signed
    # Without the flags the manifest carries neither (older agents decode it unchanged).
    assert b"thresholds" not in publish_model(fh, 6).envelope


def test_publish_with_class_thresholds_only(fh: FleetHome) -> None:
    source = publish_model(fh, 3).path
    code, output = _fedge(
        fh, "model", "publish", str(source), "--name", "inspect", "--version", "5",
        "--classes", "clean,scratch", "--class-threshold", "scratch=0.25",
    )  # fmt: skip
    assert code == 0, output
    with fh.fleet() as fleet:
        manifest = fleet.registry.get("inspect", 5).manifest
    assert manifest.thresholds == Thresholds(0.5, {"scratch": 0.25})
    assert manifest.latency_budget_ms is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--threshold", "1.5"], "thresholds.default_threshold must be in [0, 1], got 1.5"),
        (["--threshold", "nan"], "must be in [0, 1]"),
        (["--class-threshold", "scratch=-0.2"], "class_thresholds['scratch'] must be in [0, 1]"),
        (["--class-threshold", "scratch"], "'scratch' must be CLASS=VALUE"),
        (["--class-threshold", "scratch=high"], "must be CLASS=VALUE"),
        (
            ["--class-threshold", "scrach=0.3"],
            "threshold for 'scrach' is not a class of inspect:5 (did you mean 'scratch'?)",
        ),
        (["--latency-budget-ms", "-5"], "latency budget (ms) must be >= 0.001, got -5.0"),
        (["--latency-budget-ms", "0"], "latency budget (ms) must be >= 0.001, got 0.0"),
    ],
)
def test_bad_publish_flags_publish_nothing(fh: FleetHome, flags: list[str], message: str) -> None:
    source = publish_model(fh, 3).path
    code, output = _fedge(
        fh, "model", "publish", str(source), "--name", "inspect", "--version", "5",
        "--classes", "clean,scratch", *flags,
    )  # fmt: skip
    assert code != 0, output
    assert message in output, output
    with fh.fleet() as fleet:
        assert fleet.registry.latest_version("inspect") == 3
    assert not (fh.home.artifacts / "inspect" / "5").exists()


# ---------------------------------------------------------------- an edge's own rollback


def test_an_edge_that_rolled_back_shows_rolled_back_and_why(fh: FleetHome) -> None:
    deployment = deploy(fh, 2, ["st-01"])
    reason = "latency: p95 4.2 ms > budget 1 ms over 50 image(s); serving inspect:1 again"
    status = DeployStatus(
        "st-01", deployment, 1, "inspect", 2, DeployStage.ROLLED_BACK, reason, "inspect:1", 1.0
    )
    ingestor = Ingestor(fh.db, fh.settings.fleet)
    with IngestTransaction.open(fh.db) as tx:
        outcome = ingestor.handle(
            tx,
            topics.up(fh.settings.fleet, "st-01", topics.Up.DEPLOY),
            codec.encode(status),
            time.time(),
        )
    assert outcome.verdict is Verdict.STORED
    row = fh.edge_row("st-01")
    assert (row["deploy_stage"], row["deploy_reason"], row["serving"]) == (
        "rolled_back",
        reason,
        "inspect:1",
    )
    code, output = _fedge(fh, "edge", "show", "st-01")
    assert code == 0, output
    assert f"deployment {deployment} rolled_back {reason}" in output
    code, output = _fedge(fh, "edge", "list", "--json")
    assert '"deploy_stage": "rolled_back"' in output and reason in output
    code, output = _fedge(fh, "edge", "list")
    assert code == 0 and "rolled_back" in output, output

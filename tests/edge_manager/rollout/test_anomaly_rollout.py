"""A staged rollout carrying an anomaly model (issue 28), with real processes.

A real Mosquitto, the manager's serve loop in-process (it drives the rollouts), and an
agent process scoring through its local API. The classifier calls every part clean (a
constant model) and stays the same throughout: each rollout changes only the anomaly
model beside it, which the station judges as a new deployment (probation), and the
manager as a rollout (health window, criteria, rollback to the previous pair).

1. ``inspect:1`` alone, then a rollout adding ``inspect-anomaly:1`` with its station's
   own threshold: on probation at the station, passed, completed; parts are scored
   beside it and bright ones are novel.
2. A rollout to ``inspect-anomaly:2``, which calls every part unusual: the canary's
   ``novel_rate`` trips the criterion, the rollout aborts and the station goes back to
   the previous pair -- ``inspect-anomaly:1`` and its threshold.
3. A rollout of the classifier alone keeps the anomaly model the station serves.
4. Bad anomaly refs -- unknown, a classifier, one for other images, one not signed by
   this manager -- are refused with nothing started.
"""

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import Result
from conftest import (
    FleetHome,
    Processes,
    anomaly_pair_fleet,
    free_port,
    score_part,
    wait_config_applied,
    wait_until,
)
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.registry.recommendations import write_anomaly_thresholds
from fedge.edge_manager.registry.versions import Registry
from fedge.edge_manager.rollout.plan import RolloutError, make_plan
from fedge.edge_manager.rollout.service import Rollouts
from fedge.models.tiny_onnx import build_brightness_anomaly
from fedge.protocols.signing import SigningKey

pytestmark = pytest.mark.integration

EDGE = "st-01"
THRESHOLD = 14.0  # brightness x 20: dark parts about 5, bright ones about 18
PROBATION_S = 2.0


@pytest.fixture
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHome]:
    root = tmp_path_factory.mktemp("anomaly-rollout")
    # 1 scores brightness x 20; 2 brightness x 200: every part over the threshold.
    # 3 takes 64 x 64 images, not the classifier's 32 x 32.
    with anomaly_pair_fleet(root, EDGE, ((1, 32, 20.0), (2, 32, 200.0), (3, 64, 20.0))) as fh:
        models = fh.root / "models"
        with fh.fleet() as manager:
            for version in (1, 2, 3):
                # The station's own threshold for each, as an anomaly fleet job keeps it.
                write_anomaly_thresholds(
                    manager.registry.artifacts,
                    "inspect-anomaly",
                    version,
                    {EDGE: {"threshold": THRESHOLD}},
                )
            # Signed by a key that is not this manager's: a foreign registry's copy.
            Registry(manager.store, fh.home.artifacts, SigningKey.generate()).publish(
                build_brightness_anomaly(models / "anomaly-4.onnx", size=32),
                name="inspect-anomaly",
                version=4,
                classes=("good", "anomalous"),
                positive_classes=("anomalous",),
            )
        # The gate blessed the classifier (the anomaly models ride along with it).
        fh.db.conn.execute(
            "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
            "VALUES ('inspect', 1, 1, '{}', 'e-test', ?)",
            (time.time(),),
        )
        yield fh


def _stages(fh: FleetHome, deployment_id: str) -> list[dict[str, Any]]:
    return fh.db.query(
        "SELECT stage, reason FROM deploy_events WHERE deployment_id=? ORDER BY at, rowid",
        (deployment_id,),
    )


def _rollout(fh: FleetHome, rollout_id: str, state: str, timeout_s: float) -> dict[str, Any]:
    return wait_until(
        lambda: fh.row("SELECT * FROM rollouts WHERE rollout_id=?", (rollout_id,)),
        timeout_s,
        f"rollout {rollout_id} to be {state}",
        expect=lambda r: r.get("state") == state,
    )


def _cli(fh: FleetHome, *args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"FEDGE_HOME": str(fh.home.root)})


def _edge(fh: FleetHome, rollout_id: str) -> dict[str, Any]:
    return fh.row("SELECT * FROM rollout_edges WHERE rollout_id=? AND edge=?", (rollout_id, EDGE))


def test_a_rollout_carries_the_anomaly_model_and_a_bad_one_is_rolled_back(
    fleet: FleetHome, tmp_path_factory: pytest.TempPathFactory
) -> None:
    processes = Processes(tmp_path_factory.mktemp("logs"))
    port = free_port()
    fleet.set_agent_option(EDGE, "http_port", port)
    fleet.set_agent_option(EDGE, "probation_s", PROBATION_S)
    try:
        agent = processes.start(EDGE, "agent", "run", "--config", str(fleet.agents[EDGE]))
        with fleet.fleet() as manager:
            first = manager.deploy("inspect", 1, [EDGE])
        wait_until(
            lambda: [s["stage"] for s in _stages(fleet, first)],
            40,
            "the classifier alone to serve",
            expect=lambda stages: "passed" in stages,
        )
        assert "anomaly" not in score_part(port, bright=True, seed=0), agent.output()

        # 1. The classifier the station serves already, with an anomaly model beside it.
        with fleet.fleet() as manager:
            added = Rollouts(manager).start(
                "inspect:1",
                make_plan(
                    [EDGE],
                    canary=[EDGE],
                    health_window="1s",
                    abort_if="failed_activation>0,novel_rate>0.2",
                    anomaly="inspect-anomaly:1",
                ),
                now=time.time(),
            )
        done = _rollout(fleet, added, "completed", 60)
        assert json.loads(done["plan"])["anomaly"] == "inspect-anomaly:1"
        moved = _edge(fleet, added)
        assert (moved["previous_model"], moved["previous_anomaly"]) == ("inspect:1", None)
        # A new deployment for the station: on probation, then passed.
        stages = _stages(fleet, moved["deployment_id"])
        active = next(s for s in stages if s["stage"] == "active")
        assert active["reason"].startswith("on probation (previous inspect:1)"), stages
        assert "anomaly model inspect-anomaly:1 beside it" in active["reason"]
        assert "passed" in [s["stage"] for s in stages]
        wait_config_applied(fleet, EDGE, moved["config_version"])
        bright = score_part(port, bright=True, seed=1)
        assert bright["anomaly"] == {
            "model": "inspect-anomaly:1",
            "score": bright["anomaly"]["score"],
            "threshold": THRESHOLD,  # the station's own, moved with the model
        }
        assert bright["anomaly"]["score"] > THRESHOLD
        assert score_part(port, bright=False, seed=2)["anomaly"]["score"] < THRESHOLD

        # 2. An anomaly model that calls every part unusual: novel_rate sends it back.
        with fleet.fleet() as manager:
            bad = Rollouts(manager).start(
                "inspect:1",
                make_plan(
                    [EDGE],
                    canary=[EDGE],
                    health_window="10m",  # only a criterion can end it in time
                    abort_if="failed_activation>0,novel_rate>0.2",
                    anomaly="inspect-anomaly:2",
                ),
                now=time.time(),
            )
        moving = wait_until(
            lambda: _edge(fleet, bad),
            30,
            "the canary to move",
            expect=lambda r: r.get("deployment_id") is not None,
        )
        assert (moving["previous_model"], moving["previous_anomaly"]) == (
            "inspect:1",
            "inspect-anomaly:1",
        )
        wait_until(
            lambda: [s["stage"] for s in _stages(fleet, moving["deployment_id"])],
            40,
            "the new pair to be active",
            expect=lambda stages: "active" in stages,
        )
        wait_config_applied(fleet, EDGE, moving["config_version"])
        records = [score_part(port, bright=False, seed=10 + i) for i in range(25)]
        assert {r["anomaly"]["model"] for r in records} == {"inspect-anomaly:2"}
        assert all(r["anomaly"]["score"] > THRESHOLD for r in records)
        ended = _rollout(fleet, bad, "rolled_back", 60)
        assert "novel_rate=1 > 0.2" in ended["reason"], ended
        back = _edge(fleet, bad)
        assert back["state"] == "rolled_back"
        restoring = _stages(fleet, back["restore_deployment_id"])
        assert "active" in [s["stage"] for s in restoring], restoring
        # The previous pair serves again, with its threshold: dark parts are not novel.
        again = score_part(port, bright=False, seed=99)
        assert again["anomaly"]["model"] == "inspect-anomaly:1", again
        assert again["anomaly"]["threshold"] == THRESHOLD
        assert again["anomaly"]["score"] < THRESHOLD
        restored = json.loads(
            fleet.db.scalar(
                "SELECT document FROM desired WHERE edge=? AND kind='config' "
                "ORDER BY version DESC LIMIT 1",
                (EDGE,),
            )
        )
        assert restored["anomaly_threshold_model"] == "inspect-anomaly:1"
        events = [
            r["kind"]
            for r in fleet.db.query(
                "SELECT kind FROM rollout_events WHERE rollout_id=? ORDER BY rowid", (bad,)
            )
        ]
        assert events[:2] == ["created", "started"] and "aborted" in events
        assert events[-1] == "rolled_back"
        # `fedge rollout status` names the anomaly model and the edge's previous pair.
        shown = _cli(fleet, "rollout", "status", bad)
        assert shown.exit_code == 0, shown.output
        assert f"rollout {bad} inspect:1 with anomaly model inspect-anomaly:2: rolled_back" in (
            " ".join(shown.output.split())
        )
        view = json.loads(_cli(fleet, "rollout", "status", bad, "--json").output)
        assert view["plan"]["anomaly"] == "inspect-anomaly:2"
        assert view["edges"][0]["previous_anomaly"] == "inspect-anomaly:1"
        # `fedge rollout list` names the anomaly model of a rollout that carries one.
        listed = {
            r["rollout_id"]: r for r in json.loads(_cli(fleet, "rollout", "list", "--json").output)
        }
        assert (listed[bad]["model"], listed[bad]["anomaly"]) == ("inspect:1", "inspect-anomaly:2")
        table = _cli(fleet, "rollout", "list")
        assert "inspect:1 + inspect-anomaly:2" in " ".join(table.output.split()), table.output

        # 3. A rollout of the classifier alone keeps the anomaly model beside it.
        with fleet.fleet() as manager:
            classifier_only = Rollouts(manager).start(
                "inspect:1",
                make_plan([EDGE], canary=[EDGE], health_window="1s"),
                now=time.time(),
            )
        _rollout(fleet, classifier_only, "completed", 60)
        kept = _edge(fleet, classifier_only)
        assert kept["previous_anomaly"] == "inspect-anomaly:1"
        stages = _stages(fleet, kept["deployment_id"])
        assert "passed" in [s["stage"] for s in stages], stages
        wait_config_applied(fleet, EDGE, kept["config_version"])
        still = score_part(port, bright=True, seed=100)
        assert still["anomaly"]["model"] == "inspect-anomaly:1", still
        assert still["anomaly"]["threshold"] == THRESHOLD  # its threshold stayed in force
    finally:
        processes.close()


def test_bad_anomaly_refs_start_nothing(fleet: FleetHome) -> None:
    with fleet.fleet() as manager:
        manager.deploy("inspect", 1, [EDGE])  # something to go back to
        rollouts_before = fleet.db.scalar("SELECT count(*) FROM rollouts")
        desired_before = fleet.db.scalar("SELECT count(*) FROM desired")
        refusals: list[tuple[type[Exception], str, str]] = [
            (RolloutError, "inspect-anomaly:9 is not in the registry", "inspect-anomaly:9"),
            (RolloutError, "inspect:1 is the classifier itself", "inspect:1"),
            (RolloutError, "takes \\['batch', 1, 64, 64\\] images", "inspect-anomaly:3"),
            (RolloutError, "not signed by this manager's key", "inspect-anomaly:4"),
            (RolloutError, "must look like NAME:VERSION", "inspect-anomaly"),
        ]
        for error, message, ref in refusals:
            with pytest.raises(error, match=message):
                Rollouts(manager).start(
                    "inspect:1", make_plan([EDGE], anomaly=ref), now=time.time()
                )
        # A direct deployment refuses what is no anomaly model, or unsigned, too.
        for companion in (("inspect", 1), ("inspect-anomaly", 4)):
            with pytest.raises(ManagerError, match="nothing was changed"):
                manager.deploy("inspect", 1, [EDGE], anomaly=companion)
    # The CLI says so in one line, exit code 1.
    refused = _cli(
        fleet, "rollout", "start", "inspect:1", "--edges", EDGE, "--anomaly", "inspect:1"
    )
    assert refused.exit_code == 1
    assert "inspect:1 is the classifier itself, not an anomaly model" in " ".join(
        refused.output.split()
    )
    assert fleet.db.scalar("SELECT count(*) FROM rollouts") == rollouts_before
    assert fleet.db.scalar("SELECT count(*) FROM desired") == desired_before

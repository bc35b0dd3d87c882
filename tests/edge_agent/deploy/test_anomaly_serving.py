"""An anomaly model served beside the classifier (issue 28, item 3), with real processes.

A real Mosquitto, the manager's serve loop in-process, and an agent process scoring
through its local API. The classifier calls every part clean (a constant model); the
anomaly model scores a part by its brightness, so bright parts are the new defect. The
deployment names both models: the agent fetches and verifies both, each prediction
carries the anomaly score, its model and the station's anomaly threshold, a bright part
is *novel*, and the manager's ingest stores it so: novel parts lead the label queue.
An anomaly model that does not take the classifier's images fails the deployment and the
pair serving keeps serving; a restarted agent re-verifies and serves the pair again.
"""

from collections.abc import Iterator

import pytest
from conftest import (
    FleetHome,
    Processes,
    agent_status,
    anomaly_pair_fleet,
    free_port,
    score_part,
    wait_config_applied,
    wait_deploy_done,
    wait_until,
)

from fedge.console import queue_store
from fedge.edge_agent.store import LocalStore

pytestmark = pytest.mark.integration

EDGE = "st-01"
ANOMALY_THRESHOLD = 14.0  # brightness x 20: dark parts about 5, bright ones about 18


@pytest.fixture
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHome]:
    root = tmp_path_factory.mktemp("anomaly-serving")
    # inspect-anomaly:2 does not take 32 x 32 images.
    with anomaly_pair_fleet(root, EDGE, ((1, 32, 20.0), (2, 64, 20.0))) as fh:
        yield fh


def test_the_pair_serves_novel_parts_reach_the_top_of_the_queue(
    fleet: FleetHome, tmp_path_factory: pytest.TempPathFactory
) -> None:
    processes = Processes(tmp_path_factory.mktemp("logs"))
    port = free_port()
    fleet.set_agent_option(EDGE, "http_port", port)
    try:
        agent = processes.start(EDGE, "agent", "run", "--config", str(fleet.agents[EDGE]))
        with fleet.fleet() as manager:
            deployment = manager.deploy("inspect", 1, [EDGE], anomaly=("inspect-anomaly", 1))
        row = wait_deploy_done(fleet, deployment, EDGE)
        assert (row["deploy_stage"], row["serving"]) == ("active", "inspect:1"), agent.output()
        assert "anomaly model inspect-anomaly:1 beside it" in row["deploy_reason"]

        # No anomaly threshold yet: scored, no verdict.
        before = score_part(port, bright=True, seed=0)
        assert before["anomaly"]["model"] == "inspect-anomaly:1"
        assert before["anomaly"]["score"] > ANOMALY_THRESHOLD
        assert "threshold" not in before["anomaly"]

        with fleet.fleet() as manager:
            (pushed,) = manager.set_anomaly_threshold([EDGE], ANOMALY_THRESHOLD)
        wait_config_applied(fleet, EDGE, pushed.version)
        records = [score_part(port, bright=i % 3 == 2, seed=i + 1) for i in range(9)]
        for i, record in enumerate(records):
            assert record["decision"] == "accept"
            anomaly = record["anomaly"]
            assert anomaly["threshold"] == ANOMALY_THRESHOLD
            assert (anomaly["score"] > ANOMALY_THRESHOLD) == (i % 3 == 2), anomaly
        novel_ids = {r["prediction_id"] for i, r in enumerate(records) if i % 3 == 2}

        # Through the broker into the manager's store, novel parts marked so.
        stored = wait_until(
            lambda: fleet.db.query(
                "SELECT prediction_id, anomaly_model, anomaly_score, novel FROM predictions"
            ),
            20,
            "the manager to ingest the ten predictions",
            expect=lambda rows: len(rows) == 10,
        )
        by_id = {r["prediction_id"]: r for r in stored}
        assert {r["anomaly_model"] for r in stored} == {"inspect-anomaly:1"}
        assert by_id[before["prediction_id"]]["novel"] is None  # no threshold: no verdict
        assert {i for i, r in by_id.items() if r["novel"] == 1} == novel_ids
        queue = queue_store.unlabelled(fleet.db, "", "", "", limit=25)
        assert {r.prediction_id for r in queue[:3]} == novel_ids
        assert not any(r.novel for r in queue[3:])

        # The agent's own index names the anomaly model of each prediction.
        store = LocalStore(fleet.data_dir(EDGE) / "agent.db")
        try:
            kept = store.anomaly_models()
        finally:
            store.close()
        assert set(kept.values()) == {"inspect-anomaly:1"} and len(kept) == 10

        # An anomaly model that does not take the classifier's images: refused, and the
        # pair keeps serving.
        with fleet.fleet() as manager:
            refused = manager.deploy("inspect", 1, [EDGE], anomaly=("inspect-anomaly", 2))
        row = wait_deploy_done(fleet, refused, EDGE)
        assert row["deploy_stage"] == "failed"
        assert row["deploy_reason"].startswith("anomaly_mismatch: "), row["deploy_reason"]
        assert score_part(port, bright=True, seed=50)["anomaly"]["model"] == "inspect-anomaly:1"

        # A restart re-verifies the pair and serves it again.
        processes.stop(agent)
        restarted = processes.start(EDGE, "agent", "run", "--config", str(fleet.agents[EDGE]))
        status = wait_until(
            lambda: agent_status(port), 30, "the restarted agent", expect=lambda s: s["connected"]
        )
        assert status["serving"] == "inspect:1", restarted.output()
        again = score_part(port, bright=True, seed=51)
        assert again["anomaly"] == {
            "model": "inspect-anomaly:1",
            "score": again["anomaly"]["score"],
            "threshold": ANOMALY_THRESHOLD,
        }
        assert again["anomaly"]["score"] > ANOMALY_THRESHOLD
    finally:
        processes.close()

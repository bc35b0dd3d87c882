"""A degraded rollout on the console's pages (issue 30, item 5): a station rolled the model
back on its own after the rollout completed. Driven by the real ``RolloutDriver`` over a
real store; the station's deployment reports are written as ingest writes them."""

import html
import json
import re
import time
from collections.abc import Iterator

import pytest
from conftest import FleetHome, console_login, deploy, make_fleet_home, publish_model

from fedge.edge_manager.rollout.plan import make_plan
from fedge.edge_manager.rollout.service import RolloutDriver, Rollouts

EDGE = "st-01"
WHY = "probation: error rate 0.31 > 0.1"


@pytest.fixture
def degraded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetHome, str]]:
    fh = make_fleet_home(tmp_path_factory.mktemp("degraded"), edges=(EDGE,))
    publish_model(fh, 1)
    publish_model(fh, 2, seed=1)
    deploy(fh, 1, [EDGE])
    t0 = time.time()
    with fh.fleet() as fleet:
        conn = fleet.store.conn
        conn.execute("UPDATE edges SET serving='inspect:1' WHERE edge=?", (EDGE,))
        conn.execute(
            "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
            "VALUES ('inspect', 2, 1, ?, 'e-test', ?)",
            (json.dumps({"reason": "inserted by the test"}), t0),
        )
        plan = make_plan([EDGE], canary=[EDGE], health_window="1s")
        rollout_id = Rollouts(fleet).start("inspect:2", plan, now=t0)
        driver = RolloutDriver(fleet)
        driver.tick(t0)  # the canary moves

        def report(stage: str, reason: str, serving: str, at: float) -> None:
            deployment = fh.row(
                "SELECT deployment_id FROM rollout_edges WHERE rollout_id=?", (rollout_id,)
            )["deployment_id"]
            conn.execute(
                "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
                "VALUES (?,?,?,?,?,?)",
                (EDGE, deployment, stage, reason, serving, at),
            )

        report("active", "", "inspect:2", t0 + 0.5)
        report("passed", "", "inspect:2", t0 + 1.0)
        driver.tick(t0 + 5)
        assert fh.row("SELECT state FROM rollouts WHERE rollout_id=?", (rollout_id,))["state"] == (
            "completed"
        )
        report("rolled_back", WHY, "inspect:1", t0 + 6)
        conn.execute("UPDATE edges SET serving='inspect:1' WHERE edge=?", (EDGE,))
        driver.tick(t0 + 7)
    assert fh.row("SELECT state FROM rollouts WHERE rollout_id=?", (rollout_id,))["state"] == (
        "degraded"
    )
    yield fh, rollout_id
    fh.close()


def test_a_degraded_rollout_names_the_station_and_its_alert(
    degraded: tuple[FleetHome, str],
) -> None:
    fh, rollout_id = degraded
    (alert_id,) = [
        str(r["alert_id"])
        for r in fh.db.query("SELECT alert_id FROM alerts WHERE kind='local_rollback'")
    ]
    client, _ = console_login(fh, "operator")
    page = client.get(f"/rollouts/{rollout_id}").text
    section = page[page.index('id="degraded"') :].split("</section>")[0]
    assert html.escape(WHY) in section and f'href="/alerts/{alert_id}"' in section
    # Degraded: an operator may abort (send the others back), nothing else.
    assert 'id="abort"' in page and 'id="pause"' not in page and 'id="resume"' not in page

    edge = client.get(f"/edges/{EDGE}").text
    banner = edge[edge.index('id="rolled-back"') :].split("</p>")[0]
    assert "rolled back on its own, after completing" in banner and rollout_id in banner
    assert html.escape(WHY) in banner

    alerts = client.get("/alerts").text
    incident = alerts[alerts.index(f'data-incident="{EDGE}/inspect:2"') :].split("</tr>")[0]
    assert "station rolled back on its own" in incident
    assert f'href="/rollouts/{rollout_id}"' in incident
    assert 'data-field="severity">high<' in incident

    model = client.get("/models/inspect/2").text
    rolled = re.search(r'data-field="rolled-back">(.*?)</td>', model)
    assert rolled is not None and f">{EDGE}<" in rolled.group(1)
    assert client.get("/models/inspect/9").status_code == 404
    assert client.get("/models/inspect/x").status_code == 404

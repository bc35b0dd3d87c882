"""One incident on one page, in a real Chromium (issue 30, items 5-7), over a real broker,
an in-process ``ManagerService``, three agent processes and a ``fedge console`` process.

inspect:2 is rolled out canary-first to st-03 with ``abort_if alerts>0``; once st-03
serves it, three alerts about it are raised on st-03 (as the monitor raises them: input
drift, score drift, estimated accuracy) and the rollout driver rolls it back. Then:

- the rollout's page names the criterion that tripped, and one click on each of its links
  reaches each alert that tripped it; wave 1's stations read "not moved", not "waiting";
  a finished rollout offers no Pause/Resume/Abort;
- st-03's page says it was rolled back by that rollout, with the reason;
- inspect:2's page shows the gate's verdict per station with the policy in words and
  where it was rolled back;
- on the alerts page an operator ticks an incident (two alerts of st-01) and acknowledges
  it with a required note: the alerts stay open and the note is in the audit log;
- the console's "live" badge is on: the in-process ManagerService holds serve's lock.

Screenshots at 1600x1000 of each page in the test's tmp dir (``screenshots/``).
"""

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    FleetHome,
    Processes,
    deploy,
    free_port,
    make_fleet_home,
    port_open,
    publish_model,
    wait_deploy_done,
    wait_until,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from fedge.edge_manager.home.run_dir import Role, running
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.alert_store import AlertView
from fedge.edge_manager.rollout.plan import make_plan
from fedge.edge_manager.rollout.service import Rollouts
from fedge.edge_manager.serve import ManagerService

from .chromium import Shots, log_in, open_chromium, wait_for

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02", "st-03")
CANARY = "st-03"
NOTE = "camera 1 relit after maintenance; watching the next shift"
EVIDENCE = {
    "candidate": "inspect:2",
    "blessed": True,
    "reason": "better overall: 0.930 vs 0.880 (gain +0.050, needs > 0) on 80 examples",
    "failed_stations": [],
    "stations": [
        {
            "edge": edge,
            "status": "done",
            "serving": "inspect:1",
            "reference": "inspect:1",
            "examples": 40,
            "holdout": 40,
            "serving_accuracy": 0.88,
            "candidate_accuracy": 0.93,
            "delta": 0.05,
            "passed": True,
            "reason": "within the allowed drop",
        }
        for edge in ("st-01", "st-03")
    ],
    "overall": {"examples": 80, "serving_accuracy": 0.88, "candidate_accuracy": 0.93, "gain": 0.05},
    "policy": {
        "max_station_drop": 0.02,
        "min_overall_gain": 0.0,
        "min_examples": 20,
        "target_recall": 0.95,
    },
    "recommended_thresholds": None,
}


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    driver = open_chromium(tmp_path, (1600, 1000))
    try:
        yield driver
    finally:
        driver.quit()


def raise_alert(fh: FleetHome, edge: str, model: str, kind: str, value: float, limit: float) -> str:
    """An alert as the monitor raises one (tick.py writes it the same way)."""
    detail: dict[str, object] = {"reference": "gate", "reference_n": 200, "current_n": 100}
    if kind.endswith("drift"):
        detail["features"] = [
            {"feature": "brightness", "psi": value, "p_value": 0.0004, "drifted": True},
            {"feature": "contrast", "psi": 0.05, "p_value": 0.4, "drifted": False},
        ]
    alert_id = alert_store.new_alert_id()
    view = AlertView(alert_id, edge, model, kind, value, limit, detail, time.time(), None, "")
    with fh.fleet() as fleet, fleet.store.transaction() as conn:
        alert_store.insert_alert(conn, view)
    return alert_id


def rollout_state(fh: FleetHome, rollout_id: str) -> str:
    return str(fh.row("SELECT state FROM rollouts WHERE rollout_id=?", (rollout_id,))["state"])


@pytest.mark.timeout(300)
def test_a_rolled_back_rollout_on_one_page(
    tmp_path: Path, processes: Processes, browser: WebDriver
) -> None:
    shots = Shots(browser, tmp_path / "screenshots")
    fh = make_fleet_home(tmp_path, edges=EDGES)
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    try:
        service.start()
        serving = running(fh.home.root, Role.SERVE)  # the lock `manager status` reads
        assert serving is not None and serving.pid == os.getpid()
        publish_model(fh, 1, seed=1)
        publish_model(fh, 2, seed=2)
        for edge in EDGES:
            fh.set_agent_option(edge, "probation_s", 2.0)
        agents = [processes.start(e, "agent", "run", "--config", str(fh.agents[e])) for e in EDGES]
        deployment = deploy(fh, 1, EDGES)
        for edge, agent in zip(EDGES, agents, strict=True):
            assert wait_deploy_done(fh, deployment, edge)["deploy_stage"] == "active", (
                agent.output()
            )
        fh.db.conn.execute(
            "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
            "VALUES ('inspect', 2, 1, ?, 'e-test', ?)",
            (json.dumps(EVIDENCE), time.time()),
        )

        # -- the rollout: the canary moves, three alerts about inspect:2 trip it
        plan = make_plan(
            list(EDGES),
            canary=[CANARY],
            waves="100%",
            health_window="1h",  # ended by the abort, never by the window
            abort_if="failed_activation>0,alerts>0",
        )
        with fh.fleet() as fleet:
            rollout_id = Rollouts(fleet).start("inspect:2", plan, now=time.time())
        wait_until(
            lambda: fh.edge_row(CANARY).get("serving"), 40, f"{CANARY} on inspect:2",
            expect=lambda s: s == "inspect:2",
        )  # fmt: skip
        tripping = [
            raise_alert(fh, CANARY, "inspect:2", "input_drift", 0.41, 0.2),
            raise_alert(fh, CANARY, "inspect:2", "score_drift", 0.33, 0.2),
            raise_alert(fh, CANARY, "inspect:2", "accuracy_estimate", 0.62, 0.8),
        ]
        wait_until(
            lambda: rollout_state(fh, rollout_id), 60, "the rollout rolled back",
            expect=lambda s: s == "rolled_back",
        )  # fmt: skip
        reason = str(
            fh.row("SELECT reason FROM rollouts WHERE rollout_id=?", (rollout_id,))["reason"]
        )
        assert f"{CANARY}: alerts=3 > 0" in reason
        # st-01's own incident, for the operator to acknowledge: two alerts, one cause.
        acknowledged = [
            raise_alert(fh, "st-01", "inspect:1", "input_drift", 0.52, 0.2),
            raise_alert(fh, "st-01", "inspect:1", "score_drift", 0.27, 0.2),
        ]

        home = str(fh.home.root)
        token = processes.cli(
            "console", "token", "add", "olga", "--role", "admin", "--home", home
        ).stdout.strip()
        port = free_port()
        processes.start("console", "console", "--home", home, "--port", str(port))
        wait_until(lambda: port_open(port), 15, "the console to listen")
        base = f"http://127.0.0.1:{port}"
        log_in(browser, base, token)
        # serve runs in this process: the console says so (it reads serve's lock).
        wait_for(
            browser, "the page live", 20, lambda d: d.find_element(By.ID, "live").text == "live"
        )
        assert "not running" not in browser.find_element(By.TAG_NAME, "body").text

        # -- the rollout's page: what tripped it, one click to each alert behind it
        url = f"{base}/rollouts/{rollout_id}"
        browser.get(url)
        assert browser.find_element(By.ID, "rollout-state").text == "rolled back"
        criterion = browser.find_element(By.CSS_SELECTOR, '#tripped tr[data-metric="alerts"]')
        assert criterion.get_attribute("data-edge") == CANARY
        assert "open alerts" in criterion.text and "higher is worse" in criterion.text
        links = criterion.find_elements(By.CSS_SELECTOR, "a.tripped-alert")
        assert sorted(str(a.get_attribute("data-alert")) for a in links) == sorted(tripping)
        for state in browser.find_elements(
            By.CSS_SELECTOR, 'table[data-wave="1"] td[data-field="edge-state"]'
        ):
            assert state.text == "not moved (the rollout ended first)"
        assert "waiting" not in browser.find_element(By.CSS_SELECTOR, 'table[data-wave="1"]').text
        assert not browser.find_elements(By.CSS_SELECTOR, "#pause, #resume, #abort")
        shots.take("rollout-tripped-criteria")
        for alert_id in tripping:
            browser.get(url)
            browser.find_element(By.CSS_SELECTOR, f'#tripped a[data-alert="{alert_id}"]').click()
            wait_for(browser, f"alert {alert_id}", 10, lambda d: d.find_elements(By.ID, "alert-id"))
            assert browser.find_element(By.ID, "alert-id").text == alert_id
            assert browser.find_element(By.ID, "alert-rollout").text == rollout_id
            assert browser.find_element(By.ID, "alert-model").text == "inspect:2"
            assert (
                "is worse" in browser.find_element(By.CSS_SELECTOR, '[data-field="reading"]').text
            )
        shots.take("alert-behind-the-rollout")

        # -- st-03's page names the rollback and its reason
        browser.get(f"{base}/edges/{CANARY}")
        named = browser.find_element(By.ID, "rolled-back").text
        assert f"rolled back by {rollout_id}" in named and "alerts=3 > 0" in named, named
        assert rollout_id in browser.find_element(By.ID, "rollbacks").text
        shots.take("edge-rolled-back")

        # -- inspect:2's page: the gate per station, the policy in words, where it went back
        browser.get(f"{base}/models/inspect/2")
        stations = browser.find_elements(By.CSS_SELECTOR, "#gate-stations tr[data-edge]")
        assert [s.get_attribute("data-edge") for s in stations] == ["st-01", "st-03"]
        assert "passed" in stations[0].text and "+0.050" in stations[0].text
        assert "more than 0.02" in browser.find_element(By.ID, "policy").text
        row = browser.find_element(
            By.CSS_SELECTOR, f'#model-rollouts tr[data-rollout="{rollout_id}"]'
        )
        assert row.find_element(By.CSS_SELECTOR, '[data-field="rolled-back"]').text == CANARY
        assert "inspect:2" in browser.find_element(By.ID, "lineage").text
        assert browser.find_element(By.ID, "serving").text == "no station"  # all back on 1
        shots.take("model-page")

        # -- the alerts page: st-01's incident acknowledged with a note, still open
        browser.get(f"{base}/alerts")
        incident = browser.find_element(By.CSS_SELECTOR, 'tr[data-incident="st-01/inspect:1"]')
        assert len(incident.find_elements(By.CSS_SELECTOR, "li[data-alert]")) == 2
        assert "higher is worse" in incident.text
        shots.take("alerts-incidents")
        incident.find_element(By.CSS_SELECTOR, 'input[type="checkbox"]').click()
        browser.find_element(By.ID, "acknowledge").click()
        # The note is required: the browser does not send the form without one.
        assert browser.find_elements(By.CSS_SELECTOR, "#alert-note:invalid")
        browser.find_element(By.ID, "alert-note").send_keys(NOTE)
        browser.find_element(By.ID, "acknowledge").click()
        wait_for(browser, "the acknowledgement", 10, lambda d: d.find_elements(By.ID, "message"))
        incident = browser.find_element(By.CSS_SELECTOR, 'tr[data-incident="st-01/inspect:1"]')
        assert NOTE in incident.find_element(By.CSS_SELECTOR, '[data-field="ack"]').text
        for alert_id in acknowledged:
            assert alert_store.get_alert(fh.db, alert_id).is_open  # acknowledged is not cleared
        shots.take("alerts-acknowledged")
        browser.get(f"{base}/audit")
        audit = browser.find_element(By.TAG_NAME, "body").text
        assert "acknowledge-alerts" in audit and NOTE in audit
        shots.take("audit-note")
    finally:
        processes.close()
        service.stop()
        broker.stop()
        fh.close()

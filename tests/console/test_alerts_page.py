"""The alerts page: open alerts, acknowledged as ``fedge alerts clear`` does, by whom."""

import re
import time
from collections.abc import Iterator

import pytest
from conftest import FleetHome, console_login, make_fleet_home

from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.alert_store import AlertView


@pytest.fixture
def fh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHome]:
    fh = make_fleet_home(tmp_path_factory.mktemp("alerts"))
    with fh.fleet() as fleet, fleet.store.transaction() as conn:
        for alert_id, edge in (("a-000000000001", "st-01"), ("a-000000000002", "st-02")):
            view = AlertView(
                alert_id, edge, "inspect:1", "input_drift", 0.41, 0.2, {}, time.time(), None, ""
            )
            alert_store.insert_alert(conn, view)
    yield fh
    fh.close()


def test_an_operator_acknowledges_an_open_alert(fh: FleetHome) -> None:
    client, csrf = console_login(fh, "operator")
    page = client.get("/alerts")
    assert re.findall(r'data-alert="([^"]+)"', page.text) == ["a-000000000002", "a-000000000001"]
    done = client.post("/alerts/a-000000000001/clear", data={"csrf": csrf, "note": "lamp fixed"})
    assert done.status_code == 303
    view = alert_store.get_alert(fh.db, "a-000000000001")
    assert not view.is_open and view.cleared_by == "operator-1" and view.note == "lamp fixed"
    assert re.findall(r'data-alert="([^"]+)"', client.get("/alerts").text) == ["a-000000000002"]
    every = client.get("/alerts", params={"all": "1"}).text
    assert "by operator-1 (lamp fixed)" in every
    # Again, or one that does not exist: the page says why, nothing changes.
    again = client.post("/alerts/a-000000000001/clear", data={"csrf": csrf})
    assert again.status_code == 400 and 'role="alert"' in again.text
    unknown = client.post("/alerts/a-nothing/clear", data={"csrf": csrf})
    assert unknown.status_code == 400 and "no alert" in unknown.text
    tampered = client.post("/alerts/a-000000000002/clear", data={"csrf": csrf, "who": "boss"})
    assert tampered.status_code == 400 and alert_store.get_alert(fh.db, "a-000000000002").is_open


def test_a_viewer_sees_alerts_but_cannot_acknowledge(fh: FleetHome) -> None:
    client, csrf = console_login(fh, "viewer")
    assert "a-000000000002" in client.get("/alerts").text
    refused = client.post("/alerts/a-000000000002/clear", data={"csrf": csrf})
    assert refused.status_code == 403
    assert alert_store.get_alert(fh.db, "a-000000000002").is_open

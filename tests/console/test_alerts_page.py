"""The alerts pages (issue 30, item 6): one incident per station and model, each condition
in words with its severity; acknowledge (the alerts stay open) separate from clear (as
``fedge alerts clear``), several at once, a required note that lands in the audit log."""

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
        # st-02's model also lost its scores and its estimated accuracy: one incident.
        for alert_id, kind, value, threshold in (
            ("a-000000000003", "score_drift", 0.5, 0.2),
            ("a-000000000004", "accuracy_estimate", 0.61, 0.8),
        ):
            view = AlertView(
                alert_id, "st-02", "inspect:1", kind, value, threshold, {}, time.time(), None, ""
            )
            alert_store.insert_alert(conn, view)
    yield fh
    fh.close()


def test_an_operator_acknowledges_an_open_alert(fh: FleetHome) -> None:
    client, csrf = console_login(fh, "operator")
    page = client.get("/alerts")
    assert re.findall(r'data-incident="([^"]+)"', page.text) == [
        "st-02/inspect:1",
        "st-01/inspect:1",
    ]
    done = client.post("/alerts/a-000000000001/clear", data={"csrf": csrf, "note": "lamp fixed"})
    assert done.status_code == 303
    view = alert_store.get_alert(fh.db, "a-000000000001")
    assert not view.is_open and view.cleared_by == "operator-1" and view.note == "lamp fixed"
    assert re.findall(r'data-incident="([^"]+)"', client.get("/alerts").text) == ["st-02/inspect:1"]
    every = client.get("/alerts", params={"all": "1"}).text
    assert "by operator-1 (lamp fixed)" in every
    # Again, or one that does not exist: the page says why, nothing changes.
    again = client.post("/alerts/a-000000000001/clear", data={"csrf": csrf})
    assert again.status_code == 400 and 'role="alert"' in again.text
    unknown = client.post("/alerts/a-nothing/clear", data={"csrf": csrf})
    assert unknown.status_code == 400 and "no alert" in unknown.text
    tampered = client.post("/alerts/a-000000000002/clear", data={"csrf": csrf, "who": "boss"})
    assert tampered.status_code == 400 and alert_store.get_alert(fh.db, "a-000000000002").is_open
    unnoted = client.post("/alerts/a-000000000002/clear", data={"csrf": csrf, "note": " "})
    assert unnoted.status_code == 400 and "a note is required" in unnoted.text
    assert alert_store.get_alert(fh.db, "a-000000000002").is_open


def test_one_incident_per_station_and_model_said_in_words(fh: FleetHome) -> None:
    client, _ = console_login(fh, "viewer")
    page = client.get("/alerts").text
    incident = page[page.index('data-incident="st-02/inspect:1"') :].split("</tr>")[0]
    # Three alerts, one row: the most severe condition first, the direction that is bad.
    assert re.findall(r'<li data-alert="([^"]+)"', incident) == [
        "a-000000000004",
        "a-000000000002",
        "a-000000000003",
    ]
    assert 'data-field="severity">high<' in incident
    assert "estimated accuracy 0.61, under the limit 0.8 (lower is worse)" in incident
    assert "over the limit 0.2 (higher is worse)" in incident
    assert 'href="/models/inspect/1"' in incident
    one = client.get("/alerts/a-000000000004")
    assert one.status_code == 200 and "label-free (MPP) estimate" in one.text
    assert 'href="/edges/st-02"' in one.text and 'id="alert-model"' in one.text
    assert client.get("/alerts/a-nothing").status_code == 404


def audit_rows(fh: FleetHome) -> list[dict[str, object]]:
    return fh.db.query("SELECT who, action, target, detail, outcome FROM console_audit")


def test_acknowledge_is_not_clear_and_takes_a_note_for_several_at_once(fh: FleetHome) -> None:
    client, csrf = console_login(fh, "operator")
    both = {"pick-1": "a-000000000002,a-000000000003,a-000000000004", "pick-2": "a-000000000001"}
    # No note: refused, nothing acknowledged, the refusal audited.
    refused = client.post("/alerts", data={"csrf": csrf, "operation": "acknowledge", **both})
    assert refused.status_code == 400 and "a note is required" in refused.text
    assert fh.db.scalar("SELECT count(*) FROM console_alert_acks") == 0
    assert any(
        r["action"] == "acknowledge-alerts" and r["outcome"] == "invalid" for r in audit_rows(fh)
    )
    note = "lamp replaced on line 2, watching"
    done = client.post(
        "/alerts", data={"csrf": csrf, "operation": "acknowledge", "note": note, **both}
    )
    assert done.status_code == 303
    for alert_id in ("a-000000000001", "a-000000000002", "a-000000000003", "a-000000000004"):
        assert alert_store.get_alert(fh.db, alert_id).is_open  # acknowledged, still open
    page = client.get("/alerts").text
    acks = re.findall(r'data-field="ack">operator-1, [^<]*: ' + re.escape(note), page)
    assert len(acks) == 2  # both incidents
    (entry,) = [
        r for r in audit_rows(fh) if r["action"] == "acknowledge-alerts" and r["outcome"] == "done"
    ]
    assert note in str(entry["detail"]) and "a-000000000004" in str(entry["target"])
    # Clear one incident with a note: closed, as `fedge alerts clear` closes it.
    cleared = client.post(
        "/alerts",
        data={"csrf": csrf, "operation": "clear", "note": "fixed", "pick-1": both["pick-2"]},
    )
    assert cleared.status_code == 303
    view = alert_store.get_alert(fh.db, "a-000000000001")
    assert not view.is_open and view.note == "fixed" and view.cleared_by == "operator-1"
    assert any(
        r["action"] == "clear-alerts" and "fixed" in str(r["detail"]) for r in audit_rows(fh)
    )
    # A cleared alert among the ticked ones: nothing is changed.
    again = client.post(
        "/alerts",
        data={"csrf": csrf, "operation": "clear", "note": "x", **both},
    )
    assert again.status_code == 400 and "already cleared" in again.text
    assert alert_store.get_alert(fh.db, "a-000000000002").is_open
    bad = client.post("/alerts", data={"csrf": csrf, "operation": "delete", "note": "x", **both})
    assert bad.status_code == 400 and alert_store.get_alert(fh.db, "a-000000000002").is_open


def test_a_viewer_sees_alerts_but_cannot_acknowledge(fh: FleetHome) -> None:
    client, csrf = console_login(fh, "viewer")
    assert "a-000000000002" in client.get("/alerts").text
    refused = client.post("/alerts/a-000000000002/clear", data={"csrf": csrf})
    assert refused.status_code == 403
    assert alert_store.get_alert(fh.db, "a-000000000002").is_open

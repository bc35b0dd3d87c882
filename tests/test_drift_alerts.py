"""Drift alerts end to end: a real broker, the manager service and a real agent process.

A station scores seeded images from its usual distribution: the manager's monitor judges
its windows and raises nothing. The same station then scores much brighter images (a new
lamp): the monitor raises an ``input_drift`` alert, ``fedge alerts`` shows it, and an
operator subscribed to the fleet's alerts topic receives it; an operator's
acknowledgement clears it and is announced there too. No edge can write that topic.
"""

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    FleetHome,
    Processes,
    RawClient,
    deploy,
    make_fleet_home,
    publish_model,
    wait_deploy_done,
    wait_until,
)
from PIL import Image

from fedge.edge_manager.security.operators import add_operator
from fedge.edge_manager.serve import ManagerService
from fedge.monitoring.features import IMAGE_STATS
from fedge.protocols import codec, topics
from fedge.protocols.alerts import Alert, AlertKind, AlertState

pytestmark = pytest.mark.integration

EDGE = "st-01"
IDLE_EDGE = "st-02"  # enrolled, no agent: its credentials try to forge an alert
WINDOW = 40


def drop_scene(inbox: Path, prefix: str, count: int, *, brightness: float, seed: int) -> None:
    """``count`` 32x32 grayscale PNGs of mean ``brightness`` (0..255) with seeded noise,
    staged beside the inbox and moved in atomically."""
    rng = np.random.default_rng(seed)
    staging = inbox.parent / f".staging-{prefix}"
    staging.mkdir(parents=True, exist_ok=True)
    inbox.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = np.clip(rng.normal(brightness, 35.0, (32, 32)), 0, 255).astype(np.uint8)
        path = staging / f"{prefix}-{i:04d}.png"
        Image.fromarray(pixels).save(path)
        os.replace(path, inbox / path.name)


@dataclasses.dataclass
class Station:
    fh: FleetHome
    service: ManagerService
    processes: Processes
    operator: RawClient
    forger: RawClient  # IDLE_EDGE's credentials
    alerts_topic: str

    def predictions(self) -> int:
        return int(self.fh.db.scalar("SELECT count(*) FROM predictions WHERE edge=?", (EDGE,)))

    def judged_latest_window(self) -> bool:
        """The monitor judged the window ending at the newest prediction."""
        newest = self.fh.db.scalar("SELECT max(at) FROM predictions WHERE edge=?", (EDGE,))
        return bool(self.service.monitor.judged.get((EDGE, "inspect:1")) == newest)

    def published(self) -> list[Alert]:
        return [
            codec.decode(payload, Alert) for _, payload in self.operator.received(self.alerts_topic)
        ]

    def cli_alerts(self, *args: str) -> list[dict[str, Any]]:
        out = self.processes.cli("alerts", *args, "--json").stdout
        rows: list[dict[str, Any]] = json.loads(out)
        return rows


@pytest.fixture(scope="module")
def station(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Station]:
    root = tmp_path_factory.mktemp("drift-alerts")
    fh = make_fleet_home(root, edges=(EDGE, IDLE_EDGE))
    fh.home.save_settings(
        dataclasses.replace(fh.settings, monitor_interval_s=0.2, monitor_min_window=WINDOW)
    )
    credential = add_operator(fh.home, "ops")
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    processes = Processes(root / "logs", env={"FEDGE_HOME": str(fh.home.root)})
    operator = fh.client(broker.port, credential.name)
    forger = fh.client(broker.port, IDLE_EDGE)
    try:
        service.start()
        alerts_topic = topics.alerts(fh.settings.fleet)
        for client in (operator, forger):
            client.wait_connected()
            # Mosquitto grants any subscription and filters by the ACL when delivering.
            assert client.subscribe(alerts_topic) == [1]
        publish_model(fh, 1, seed=1)
        agent = processes.start(EDGE, "agent", "run", "--config", str(fh.agents[EDGE]))
        row = wait_deploy_done(fh, deploy(fh, 1, [EDGE]), EDGE)
        assert (row["deploy_stage"], row["serving"]) == ("active", "inspect:1"), agent.output()
        yield Station(fh, service, processes, operator, forger, alerts_topic)
    finally:
        operator.close()
        forger.close()
        processes.close()
        service.stop()
        broker.stop()
        fh.close()


def test_in_distribution_then_brighter_images(station: Station) -> None:
    inbox = station.fh.inbox(EDGE)

    # -- the usual scene: two windows judged, nothing raised
    drop_scene(inbox, "usual", 2 * WINDOW, brightness=90.0, seed=11)
    wait_until(station.predictions, 30, "the usual images' predictions", expect=lambda n: n == 80)
    stats = json.loads(station.fh.db.scalar("SELECT stats FROM predictions LIMIT 1"))
    assert set(stats) == {"mean", "std", "p05", "p95", "edges"}
    wait_until(station.judged_latest_window, 15, "the monitor to judge the usual window")
    assert station.cli_alerts("--all") == []
    assert station.published() == []
    # One estimate per WINDOW predictions (windows that do not overlap).
    (estimate, *_) = json.loads(
        station.processes.cli("alerts", "estimates", "--edge", EDGE, "--json").stdout
    )
    assert (estimate["model"], estimate["n"], estimate["mpp"]) == ("inspect:1", WINDOW, None)
    assert 0.5 <= estimate["calibration"] <= 1.0

    # -- a brighter lamp: input drift raised, shown and published, once
    drop_scene(inbox, "bright", WINDOW, brightness=200.0, seed=12)
    wait_until(station.predictions, 30, "the bright images' predictions", expect=lambda n: n == 120)
    wait_until(station.judged_latest_window, 15, "the monitor to judge the bright window")
    shown = station.cli_alerts("--edge", EDGE)
    drift = [a for a in shown if a["kind"] == "input_drift"]
    assert len(drift) == 1, shown
    assert drift[0]["open"] is True and drift[0]["model"] == "inspect:1"
    # Raised as soon as a window showed it, maybe before every bright image had arrived:
    # the tails of the histogram move first.
    assert drift[0]["detail"]["drifted"] and set(drift[0]["detail"]["drifted"]) <= set(IMAGE_STATS)
    assert drift[0]["value"] >= drift[0]["threshold"] == 0.25
    published = wait_until(
        station.published,
        10,
        "the alert on the alerts topic",
        expect=lambda got: any(a.condition is AlertKind.INPUT_DRIFT for a in got),
    )
    (message,) = [a for a in published if a.condition is AlertKind.INPUT_DRIFT]
    assert (message.alert_id, message.state, message.edge) == (
        drift[0]["alert_id"],
        AlertState.RAISED,
        EDGE,
    )
    table = station.processes.cli("alerts").stdout
    assert drift[0]["alert_id"] in table and "input_drift" in table

    # -- an operator acknowledges it: cleared, recorded, announced; not raised again
    cleared = station.processes.cli(
        "alerts", "clear", drift[0]["alert_id"], "--who", "alice", "--note", "new lamp"
    )
    assert f"cleared {drift[0]['alert_id']}" in cleared.stdout
    wait_until(
        station.published,
        10,
        "the acknowledgement on the alerts topic",
        expect=lambda got: any(a.state is AlertState.CLEARED for a in got),
    )
    (ack,) = [a for a in station.published() if a.state is AlertState.CLEARED]
    assert (ack.alert_id, ack.cleared_by) == (drift[0]["alert_id"], "alice")
    again = station.processes.cli("alerts", "clear", drift[0]["alert_id"], expect=1)
    assert "already cleared" in again.stderr
    drop_scene(inbox, "bright-more", 5, brightness=200.0, seed=13)
    wait_until(station.predictions, 30, "more bright predictions", expect=lambda n: n == 125)
    wait_until(station.judged_latest_window, 15, "the monitor to judge the newest window")
    assert [a for a in station.cli_alerts() if a["kind"] == "input_drift"] == []
    (row,) = [a for a in station.cli_alerts("--all") if a["kind"] == "input_drift"]
    assert (row["cleared_by"], row["note"]) == ("alice", "new lamp")


def test_no_edge_can_write_or_read_the_alerts_topic(station: Station) -> None:
    forged = Alert(
        "a-forged",
        station.fh.settings.fleet,
        EDGE,
        "inspect:1",
        AlertKind.SCORE_DRIFT,
        AlertState.RAISED,
        9.0,
        0.25,
        "{}",
        1.0,
    )
    assert station.forger.publish(station.alerts_topic, codec.encode(forged)) >= 0x80
    assert all(a.alert_id != "a-forged" for a in station.published())
    # Alerts are for operators: the edge saw none of those the operator received.
    assert station.published()
    assert station.forger.received(station.alerts_topic) == []


def test_alerts_cli_refuses_bad_input(station: Station) -> None:
    unknown = station.processes.cli("alerts", "clear", "a-nope", expect=1)
    assert "no alert 'a-nope'" in unknown.stderr
    bad_limit = station.processes.cli("alerts", "estimates", "--limit", "0", expect=2)
    assert "limit" in bad_limit.stderr
    assert station.processes.cli("alerts", "--edge", "st-99", "--json").stdout.strip() == "[]"

"""Honest states (issue 30, item 1): an online edge ages into stale, times say their zone,
a pending config says why, and the fleet's health says when nothing is live."""

import dataclasses
import time
from pathlib import Path

from fedge.console import freshness
from fedge.console.freshness import Pending, pending, shown_state, stale_after_s, sync_text
from fedge.console.health import fleet_health
from fedge.console.views import FleetRow

NOW = 1_800_000_000.0


def test_an_online_edge_is_stale_after_three_missed_reports_and_a_grace() -> None:
    assert stale_after_s() == 20.0
    assert stale_after_s(1.0) == 8.0
    assert shown_state("online", NOW - 19.9, NOW) == "online"
    assert shown_state("online", NOW - 20.1, NOW) == "stale"
    assert shown_state("online", NOW - 9.0, NOW, report_interval_s=1.0) == "stale"
    assert shown_state("online", None, NOW) == "stale"
    # What the edge itself said is never aged: lost, offline, revoked stay as reported.
    for state in ("lost", "offline", "never-seen", "revoked"):
        assert shown_state(state, NOW - 3600, NOW) == state


def test_relative_times_and_the_zone() -> None:
    assert [freshness.ago(s) for s in (0.5, 12, 13 * 60, 2 * 3600, 3 * 86400)] == [
        "just now",
        "12 s ago",
        "13 min ago",
        "2 h ago",
        "3 days ago",
    ]
    shown = freshness.when(NOW)
    assert shown.startswith("20") and len(shown.split()) == 3, shown  # date, time, zone
    assert freshness.when(None) == "-"


def test_a_pending_config_says_since_when_and_why() -> None:
    waiting = Pending(3, NOW - 60, NOW - 59)
    assert sync_text(True, "online", NOW, None) == "in sync"
    assert sync_text(False, "stale", NOW - 800, waiting).endswith(
        f"the station is stale, last seen {freshness.when(NOW - 800)}"
    )
    assert "pending v3 since" in sync_text(False, "online", NOW, waiting)
    assert "never connected" in sync_text(False, "never-seen", None, waiting)
    unpublished = Pending(3, NOW - 60, None)
    assert "not published yet" in sync_text(False, "online", NOW, unpublished)
    assert sync_text(False, "online", NOW, waiting, revoked=True).startswith("revoked")
    refused = pending(3, NOW, NOW, "rejected:3", "bad class")
    assert sync_text(False, "online", NOW, refused) == "rejected v3: bad class"
    # A rejection of an older version is not this one's.
    assert pending(3, NOW, NOW, "rejected:2", "bad class").rejected == ""


def row(edge: str, state: str) -> FleetRow:
    return FleetRow(edge, state, True, {})


def test_live_means_serve_runs_and_a_station_reports() -> None:
    fine = fleet_health(None, [row("st-01", "online"), row("st-02", "never-seen")], NOW, NOW)
    assert fine.live and fine.banner == ""
    stale = fleet_health(None, [row("st-01", "stale"), row("st-02", "stale")], NOW - 780, NOW)
    assert not stale.live
    assert "2 stations stale" in stale.banner and "st-01, st-02" in stale.banner
    assert "the last report arrived 13 min ago" in stale.banner
    gone = fleet_health("`fedge manager serve` is not running", [row("st-01", "online")], NOW)
    assert not gone.live and gone.banner.startswith("`fedge manager serve` is not running.")
    many = fleet_health(None, [row(f"st-{i:02d}", "stale") for i in range(8)], None, NOW)
    assert "and 3 more" in many.banner
    assert "No station is reporting; the last report arrived never" in many.banner


def test_an_unwritable_store_is_said_and_the_fleet_is_not_live(tmp_path: Path) -> None:
    """Issue 33, item 2: the console says when ``manager serve`` holds reports because
    its store cannot be written (as ``serve.json`` reports it), and stops saying it after."""
    import os

    from fedge import pidlock
    from fedge.console import health
    from fedge.edge_manager.home.run_dir import (
        BrokerLink,
        Role,
        ServeState,
        pid_path,
        write_serve_state,
    )

    fd = pidlock.acquire(pid_path(tmp_path, Role.SERVE))
    assert isinstance(fd, int)
    try:
        state = ServeState(
            pid=os.getpid(),
            fleet="plant-a",
            grpc_port=50551,
            broker_address="127.0.0.1:1883",
            broker=BrokerLink.CONNECTED,
            store="unwritable",
            store_detail="OperationalError: database or disk is full",
            held=240,
            store_since=time.time() - 30,
        )
        write_serve_state(tmp_path, state)
        said = health.notice(tmp_path)
        assert said is not None and "unwritable since 30 s ago" in said
        assert "240 message(s) wait" in said and "disk is full" in said
        assert not health.fleet_health(said, [], None).live
        write_serve_state(tmp_path, dataclasses.replace(state, store="ok", held=0))
        assert health.notice(tmp_path) is None
    finally:
        os.close(fd)

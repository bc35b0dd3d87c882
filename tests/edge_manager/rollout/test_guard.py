"""A staged rollout owns its edges, and one broken rollout does not stop the others.

Real SQLite stores of real manager homes (no broker: nothing here needs an edge to
answer): deploys and threshold changes on an edge in an unfinished rollout are refused
naming the rollout unless forced, while the rollout's own moves go through; the driver
stops a rollout whose step raises and still steps the rest; ``rollout start`` targets
the edges of the model's line by default.
"""

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, Processes, deploy, make_fleet_home, publish_model

from fedge.edge_manager.rollout.plan import RolloutError, make_plan
from fedge.edge_manager.rollout.service import RolloutDriver, Rollouts, default_edges

EDGES = ("st-01", "st-02", "st-03")


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    home = make_fleet_home(tmp_path, edges=EDGES)
    publish_model(home, 1, seed=1)
    publish_model(home, 2, seed=2)
    home.db.conn.execute(
        "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
        "VALUES ('inspect', 2, 1, ?, 'e-test', ?)",
        (json.dumps({"note": "inserted by the test"}), time.time()),
    )
    deploy(home, 1, ["st-01", "st-02"])  # st-03 serves nothing
    try:
        yield home
    finally:
        home.close()


def _events(fh: FleetHome, rollout_id: str) -> list[tuple[str, str]]:
    rows = fh.db.query(
        "SELECT kind, detail FROM rollout_events WHERE rollout_id=? ORDER BY rowid", (rollout_id,)
    )
    return [(str(r["kind"]), str(r["detail"])) for r in rows]


def test_changes_to_an_edge_in_a_rollout_are_refused_unless_forced(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        rollout_id = Rollouts(fleet).start(
            "inspect:2", make_plan(["st-01"]), now=time.time(), paused=True
        )
        desired = fh.db.scalar("SELECT count(*) FROM desired")
        named = f"st-01 \\({rollout_id}\\).*`fedge rollout abort {rollout_id}` first"
        with pytest.raises(RolloutError, match=f"cannot deploy: .*{named}"):
            fleet.deploy("inspect", 1, ["st-02", "st-01"])
        with pytest.raises(RolloutError, match=f"cannot set a threshold: .*{named}"):
            fleet.set_threshold(["st-01"], 0.4)
        with pytest.raises(RolloutError, match=f"cannot unset a threshold: .*{named}"):
            fleet.clear_threshold(["st-01"], "scratch")
        # One value each (``--anomaly recommended``): refused for all before any is pushed,
        # though st-02 comes first and is free.
        with pytest.raises(RolloutError, match=f"cannot set an anomaly threshold: .*{named}"):
            fleet.set_anomaly_thresholds({"st-02": 12.5, "st-01": 14.0})
        assert fh.db.scalar("SELECT count(*) FROM desired") == desired  # nothing changed
        fleet.deploy("inspect", 1, ["st-02"])  # outside the rollout: as before
        fleet.set_threshold(["st-01"], 0.4, force=True)
        fleet.deploy("inspect", 1, ["st-01"], force=True)

        # The rollout's own move still goes through the guard.
        Rollouts(fleet).resume(rollout_id, time.time())
        assert RolloutDriver(fleet).tick(time.time()) == 1
        assert fleet.deployed_model("st-01") == ("inspect", 2)
        config = fleet.desired_config("st-01")
        assert config is not None and config.model == "inspect:2"


def test_the_cli_names_the_rollout_and_force_goes_through(
    fh: FleetHome, processes: Processes
) -> None:
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    with fh.fleet() as fleet:
        rollout_id = Rollouts(fleet).start(
            "inspect:2", make_plan(["st-01"]), now=time.time(), paused=True
        )
    refused = processes.cli("deploy", "inspect:1", "--edges", "st-01", expect=1)
    said = " ".join(refused.stderr.split())
    assert f"st-01 ({rollout_id})" in said and f"`fedge rollout abort {rollout_id}` first" in said
    assert "Traceback" not in refused.stderr
    processes.cli("deploy", "inspect:1", "--edges", "st-01", "--force")
    refused = processes.cli("edge", "set-threshold", "st-01", "0.4", expect=1)
    assert f"fedge rollout abort {rollout_id}" in " ".join(refused.stderr.split())
    processes.cli("edge", "set-threshold", "st-01", "0.4", "--force")


def test_one_broken_rollout_does_not_starve_the_others(fh: FleetHome) -> None:
    now = time.time()
    with fh.fleet() as fleet:
        rollouts = Rollouts(fleet)
        broken = rollouts.start("inspect:2", make_plan(["st-01"]), now=now)
        healthy = rollouts.start("inspect:2", make_plan(["st-02"]), now=now + 0.001)
        # Its plan cannot be read: the step raises, and so does the abort it leads to.
        fleet.store.conn.execute(
            "UPDATE rollouts SET plan='{\"edges\": 5}' WHERE rollout_id=?", (broken,)
        )
        driver = RolloutDriver(fleet)
        assert driver.tick(now + 1) == 2
        row = fh.row(
            "SELECT state, reason, finished_at FROM rollouts WHERE rollout_id=?", (broken,)
        )
        assert row["state"] == "paused" and row["finished_at"] is None
        assert "stored rollout plan is damaged" in row["reason"]
        assert "aborting it failed too" in row["reason"]
        assert _events(fh, broken)[-1] == ("error", row["reason"])
        healthy_row = fh.row("SELECT state, wave FROM rollouts WHERE rollout_id=?", (healthy,))
        assert (healthy_row["state"], healthy_row["wave"]) == ("wave", 1)  # moved: no canary
        assert fleet.deployed_model("st-02") == ("inspect", 2)
        # The same error on the next tick is not recorded again.
        events = len(_events(fh, broken))
        driver.tick(now + 2)
        assert len(_events(fh, broken)) == events


def test_rollout_start_targets_the_edges_of_the_models_line_by_default(
    fh: FleetHome, processes: Processes
) -> None:
    with fh.fleet() as fleet:
        assert default_edges(fleet, "inspect") == ["st-01", "st-02"]
        assert default_edges(fleet, "other") == []
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    started = processes.cli("rollout", "start", "inspect:2", "--waves", "100%")
    assert "-> 2 edge(s)" in started.stdout
    rows = fh.db.query("SELECT edge FROM rollout_edges ORDER BY edge")
    assert [r["edge"] for r in rows] == ["st-01", "st-02"]  # st-03 runs nothing: left out
    refused = processes.cli("rollout", "start", "other:1", expect=1)
    assert "no edge is deployed with a version of other" in " ".join(refused.stderr.split())


def _deploy_event(fh: FleetHome, rollout_id: str, edge: str, stage: str, at: float) -> None:
    """What the edge's agent reports on up/deploy, as ingest stores it."""
    deployment = fh.db.scalar(
        "SELECT deployment_id FROM rollout_edges WHERE rollout_id=? AND edge=?", (rollout_id, edge)
    )
    fh.db.conn.execute(
        "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
        "VALUES (?,?,?,?,?,?)",
        (edge, deployment, stage, f"{stage} by the test", "inspect:2", at),
    )


def test_waves_wait_for_the_stations_verdicts_and_a_later_local_rollback_degrades(
    fh: FleetHome,
) -> None:
    """Issue 32, item 1, through the store: the wave completes only after the station's
    ``passed``; a rollback the station makes after completion turns the rollout
    ``degraded`` with a ``local_rollback`` alert the monitor leaves open."""
    from fedge.edge_manager.monitor.tick import Monitor, policy_from
    from fedge.edge_manager.rollout.service import DEGRADED_WATCH_S

    t0 = time.time()
    with fh.fleet() as fleet:
        plan = make_plan(["st-01"], health_window="1s")
        rollout_id = Rollouts(fleet).start("inspect:2", plan, now=t0)
        driver = RolloutDriver(fleet)
        assert driver.tick(t0) == 1  # st-01 moved
        _deploy_event(fh, rollout_id, "st-01", "active", t0 + 1)
        driver.tick(t0 + 5)  # its window is over, its probation is not
        state = fh.db.scalar("SELECT state FROM rollouts WHERE rollout_id=?", (rollout_id,))
        assert state == "wave"
        _deploy_event(fh, rollout_id, "st-01", "passed", t0 + 6)
        assert driver.tick(t0 + 7) == 1
        state = fh.db.scalar("SELECT state FROM rollouts WHERE rollout_id=?", (rollout_id,))
        assert state == "completed"
        assert driver.tick(t0 + 8) == 0  # completed and quiet: nothing to do

        _deploy_event(fh, rollout_id, "st-01", "rolled_back", t0 + 9)
        assert driver.tick(t0 + 10) == 1
        row = fh.db.query("SELECT state, reason FROM rollouts WHERE rollout_id=?", (rollout_id,))
        assert row[0]["state"] == "degraded" and "st-01" in row[0]["reason"]
        assert ("degraded", "rolled inspect:2 back on its own: rolled_back by the test") in (
            _events(fh, rollout_id)
        )
        assert driver.tick(t0 + 11) == 0  # degraded once, one alert
        alerts = fh.db.query(
            "SELECT edge, model, kind, detail FROM alerts WHERE cleared_at IS NULL"
        )
        assert [(a["edge"], a["model"], a["kind"]) for a in alerts] == [
            ("st-01", "inspect:2", "local_rollback")
        ]
        assert json.loads(alerts[0]["detail"])["rollout"] == rollout_id
        # st-01 serves no inspect:2 now: the monitor's "unserved" clearing leaves it open.
        Monitor(fleet.store, fleet.fleet, policy_from(40, 0.8)).tick(t0 + 12)
        assert fh.db.scalar("SELECT count(*) FROM alerts WHERE cleared_at IS NULL") == 1
        # A rollout completed longer ago than the watch is not looked at again.
        assert driver.tick(t0 + 12 + DEGRADED_WATCH_S) == 0


def test_a_model_proven_on_the_station_is_passed_without_a_probation(fh: FleetHome) -> None:
    """Rolling back to a known-good model: the agent starts no probation; its ``active``
    report that says so counts as the station's verdict (what an agent of before the
    explicit ``passed`` sends), so the wave does not wait into a probation timeout."""
    t0 = time.time()
    with fh.fleet() as fleet:
        plan = make_plan(["st-01"], health_window="1s")
        rollout_id = Rollouts(fleet).start("inspect:2", plan, now=t0)
        driver = RolloutDriver(fleet)
        driver.tick(t0)
        deployment = fh.db.scalar(
            "SELECT deployment_id FROM rollout_edges WHERE rollout_id=? AND edge='st-01'",
            (rollout_id,),
        )
        fh.db.conn.execute(
            "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
            "VALUES ('st-01', ?, 'active', 'not on probation: inspect:2 is proven on this "
            "station', 'inspect:2', ?)",
            (deployment, t0 + 1),
        )
        driver.tick(t0 + 3)
        state = fh.db.scalar("SELECT state FROM rollouts WHERE rollout_id=?", (rollout_id,))
        assert state == "completed"

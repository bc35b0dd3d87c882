"""Staged rollouts against a real broker, a real manager and real agent processes.

Three stations serve inspect:1 at threshold 0.6. A model that fails on the canary is
stopped there and the canary goes back to inspect:1 and 0.6; a model whose labels
disagree on the canary is rolled back too; a good model completes wave by wave with the
thresholds the gate recommended. An enrolled edge with no agent (offline) never settles
and never confirms its rollback: the timeouts end the rollout anyway. Bad input starts
nothing. (The gate's verdicts are inserted into ``gate_results`` by hand here: the gate
is built in parallel.) Each test counts only its own rollouts, so any order works.
"""

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
from conftest import (
    FleetHome,
    Processes,
    deploy,
    drop_images,
    make_fleet_home,
    publish_model,
    set_threshold,
    wait_config_applied,
    wait_deploy_done,
    wait_until,
)

from fedge.edge_manager.errors import ManagerError, UnknownEdgeError, UnknownModelError
from fedge.edge_manager.rollout.health import MIN_AGREEMENT_LABELS
from fedge.edge_manager.rollout.machine import RolloutState
from fedge.edge_manager.rollout.plan import RolloutError, make_plan
from fedge.edge_manager.rollout.service import Rollouts
from fedge.edge_manager.serve import ManagerService
from fedge.transport.broker import MosquittoBroker

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02", "st-03")
OFFLINE = "st-04"  # enrolled and deployed to, but no agent ever runs there
THRESHOLD = 0.6
GOOD, BROKEN, DISAGREES, UNBLESSED = 2, 3, 4, 5


@dataclass
class Plant:
    fh: FleetHome
    broker: MosquittoBroker
    service: ManagerService
    processes: Processes


def bless(
    fh: FleetHome,
    version: int,
    *,
    blessed: bool = True,
    recommended: float | None = None,
    at: float | None = None,
) -> None:
    evidence: dict[str, Any] = {"note": "inserted by the test"}
    if recommended is not None:
        evidence["recommended_thresholds"] = {
            "default_threshold": recommended,
            "class_thresholds": {"scratch": recommended},
        }
    fh.db.conn.execute(
        "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
        "VALUES (?,?,?,?,?,?)",
        ("inspect", version, int(blessed), json.dumps(evidence), "e-test", at or time.time()),
    )


def start(fh: FleetHome, model: str, plan_edges: tuple[str, ...] = EDGES, **plan: Any) -> str:
    with fh.fleet() as fleet:
        return Rollouts(fleet).start(model, make_plan(list(plan_edges), **plan), now=time.time())


def rollout_row(fh: FleetHome, rollout_id: str) -> dict[str, Any]:
    return fh.row("SELECT * FROM rollouts WHERE rollout_id=?", (rollout_id,))


def wait_state(fh: FleetHome, rollout_id: str, state: str, timeout_s: float = 40.0) -> None:
    wait_until(
        lambda: rollout_row(fh, rollout_id).get("state"),
        timeout_s,
        f"rollout {rollout_id} to be {state}",
        expect=lambda s: s == state,
    )


def edge_rows(fh: FleetHome, rollout_id: str) -> dict[str, dict[str, Any]]:
    rows = fh.db.query("SELECT * FROM rollout_edges WHERE rollout_id=?", (rollout_id,))
    return {str(r["edge"]): r for r in rows}


def desired_config(fh: FleetHome, edge: str) -> dict[str, Any]:
    with fh.fleet() as fleet:
        config = fleet.desired_config(edge)
    assert config is not None
    return {"model": config.model, "threshold": config.default_threshold, "version": config.version}


def deployed_versions(fh: FleetHome, edge: str) -> list[int]:
    rows = fh.db.query(
        "SELECT d.model_version FROM desired x JOIN deployments d ON d.deployment_id = "
        "json_extract(x.document, '$.deployment_id') WHERE x.edge=? AND x.kind='deploy' "
        "ORDER BY x.version",
        (edge,),
    )
    return [int(r["model_version"]) for r in rows]


def assert_back_on_v1(fh: FleetHome, edge: str) -> None:
    wait_until(
        lambda: fh.edge_row(edge),
        30,
        f"{edge} to serve inspect:1 again",
        expect=lambda r: r.get("serving") == "inspect:1",
    )
    config = desired_config(fh, edge)
    assert (config["model"], config["threshold"]) == ("inspect:1", THRESHOLD)
    wait_config_applied(fh, edge, config["version"])


@pytest.fixture(scope="module")
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    root = tmp_path_factory.mktemp("rollouts")
    fh = make_fleet_home(root, edges=(*EDGES, OFFLINE))
    broker = fh.broker()
    broker.start()
    service = ManagerService(fh.home)
    processes = Processes(root / "logs")
    try:
        service.start()
        publish_model(fh, 1, seed=1)
        publish_model(fh, GOOD, seed=2)
        publish_model(fh, BROKEN, broken=True)
        publish_model(fh, DISAGREES, seed=4)
        publish_model(fh, UNBLESSED, seed=5)
        for edge in EDGES:  # a new model's probation ends in 2 s: each wave waits for it
            fh.set_agent_option(edge, "probation_s", 2.0)
        agents = [processes.start(e, "agent", "run", "--config", str(fh.agents[e])) for e in EDGES]
        deployment = deploy(fh, 1, EDGES)
        for edge, agent in zip(EDGES, agents, strict=True):
            row = wait_deploy_done(fh, deployment, edge)
            assert row["deploy_stage"] == "active", agent.output()
            wait_config_applied(fh, edge, set_threshold(fh, edge, THRESHOLD))
        deploy(fh, 1, [OFFLINE])  # its desired model: what a rollout would send it back to
        yield Plant(fh, broker, service, processes)
    finally:
        processes.close()
        service.stop()
        broker.stop()
        fh.close()


def test_bad_input_starts_nothing(plant: Plant) -> None:
    fh = plant.fh
    desired_before = fh.db.scalar("SELECT count(*) FROM desired")
    rollouts_before = fh.db.scalar("SELECT count(*) FROM rollouts")
    edges_before = fh.db.scalar("SELECT count(*) FROM rollout_edges")
    bless(fh, UNBLESSED, blessed=True, at=1.0)
    bless(fh, UNBLESSED, blessed=False, at=2.0)  # the newest verdict counts
    refusals: list[tuple[type[Exception], str, Any]] = [
        (UnknownModelError, "inspect:9 is not in the registry", lambda: start(fh, "inspect:9")),
        (RolloutError, "was never gated", lambda: start(fh, "inspect:1")),
        (
            RolloutError,
            "inspect:5 was not blessed by the gate",
            lambda: start(fh, f"inspect:{UNBLESSED}"),
        ),
        (ManagerError, "must look like NAME:VERSION", lambda: start(fh, "inspect")),
        (UnknownEdgeError, "unknown edge\\(s\\) st-99", lambda: start(fh, "inspect:1", ("st-99",))),
        (
            RolloutError,
            "unknown metric 'eror_rate'",
            lambda: start(fh, "inspect:1", abort_if="eror_rate>0.01"),
        ),
        (
            RolloutError,
            "comparison '<' is not supported",
            lambda: start(fh, "inspect:1", abort_if="latency_p95_ms<80"),
        ),
        (RolloutError, "must end at 100%", lambda: start(fh, "inspect:1", waves="25%,50%")),
    ]
    for error, message, attempt in refusals:
        with pytest.raises(error, match=message):
            attempt()
    assert fh.db.scalar("SELECT count(*) FROM rollouts") == rollouts_before
    assert fh.db.scalar("SELECT count(*) FROM rollout_edges") == edges_before

    # An explicit --force-unblessed is allowed and recorded; an overlapping one is not.
    # (Started paused, so that the serve loop's driver moves nothing meanwhile.)
    with fh.fleet() as fleet:
        rollouts = Rollouts(fleet)
        forced = rollouts.start(
            f"inspect:{UNBLESSED}",
            make_plan(["st-01"]),
            now=time.time(),
            force_unblessed=True,
            paused=True,
        )
        overlapping = make_plan(["st-01", "st-02"])
        with pytest.raises(RolloutError, match=f"st-01 \\({forced}\\); wait for it"):
            rollouts.start("inspect:1", overlapping, now=time.time(), force_unblessed=True)
        rollouts.abort(forced, time.time())
    assert rollout_row(fh, forced)["forced_unblessed"] == 1
    kinds = [
        r["kind"]
        for r in fh.db.query(
            "SELECT kind FROM rollout_events WHERE rollout_id=? ORDER BY rowid", (forced,)
        )
    ]
    assert kinds == ["created", "forced", "paused", "aborted"]
    assert rollout_row(fh, forced)["finished_at"] is not None  # nothing had moved
    assert fh.db.scalar("SELECT count(*) FROM rollouts") == rollouts_before + 1
    assert fh.db.scalar("SELECT count(*) FROM desired") == desired_before


def test_a_model_failing_on_the_canary_never_leaves_it_and_is_rolled_back(plant: Plant) -> None:
    fh = plant.fh
    bless(fh, BROKEN, recommended=0.3)
    started = time.monotonic()
    rollout_id = start(
        fh,
        f"inspect:{BROKEN}",
        canary=["st-02"],
        waves="50%,100%",
        health_window="2s",
        abort_if="failed_activation>0",
    )
    wait_state(fh, rollout_id, "rolled_back")
    elapsed = time.monotonic() - started
    row = rollout_row(fh, rollout_id)
    assert "st-02: failed_activation=1 > 0" in row["reason"]
    edges = edge_rows(fh, rollout_id)
    assert {e: r["state"] for e, r in edges.items()} == {
        "st-01": "waiting",
        "st-02": "rolled_back",
        "st-03": "waiting",
    }
    assert edges["st-02"]["previous_model"] == "inspect:1"
    # The bad model reached the canary only.
    assert BROKEN in deployed_versions(fh, "st-02")
    assert BROKEN not in deployed_versions(fh, "st-01") + deployed_versions(fh, "st-03")
    assert_back_on_v1(fh, "st-02")
    assert elapsed < 60, elapsed


def test_a_canary_whose_labels_disagree_is_rolled_back(plant: Plant) -> None:
    fh = plant.fh
    edge = "st-02"
    # inspect:1's predictions on the canary, labelled as it decided: agreement 1.0.
    names = drop_images(fh.inbox(edge), "before", MIN_AGREEMENT_LABELS, seed=11)
    wait_until(
        lambda: fh.db.query(
            "SELECT prediction_id FROM predictions WHERE edge=? AND source LIKE 'file:before%'",
            (edge,),
        ),
        30,
        "inspect:1's predictions",
        expect=lambda rows: len(rows) == len(names),
    )
    _label_all(fh, edge, "inspect:1", agree=True)

    bless(fh, DISAGREES)
    rollout_id = start(
        fh,
        f"inspect:{DISAGREES}",
        canary=[edge],
        waves="100%",
        # Ended by the abort, not by the window: a loaded machine cannot let it expire.
        health_window="1h",
        abort_if="failed_activation>0,agreement_drop>0.02",
    )
    wait_until(
        lambda: fh.edge_row(edge),
        30,
        f"{edge} on inspect:{DISAGREES}",
        expect=lambda r: r.get("serving") == f"inspect:{DISAGREES}",
    )
    assert rollout_row(fh, rollout_id)["state"] == "canary"
    drop_images(fh.inbox(edge), "after", MIN_AGREEMENT_LABELS, seed=12)
    wait_until(
        lambda: fh.db.scalar(
            "SELECT count(*) FROM predictions WHERE edge=? AND model=?",
            (edge, f"inspect:{DISAGREES}"),
        ),
        30,
        "the new model's predictions",
        expect=lambda n: n == MIN_AGREEMENT_LABELS,
    )
    _label_all(fh, edge, f"inspect:{DISAGREES}", agree=False)

    wait_state(fh, rollout_id, "rolled_back")
    assert "st-02: agreement_drop=1 > 0.02" in rollout_row(fh, rollout_id)["reason"]
    assert DISAGREES not in deployed_versions(fh, "st-01") + deployed_versions(fh, "st-03")
    assert_back_on_v1(fh, edge)


def _label_all(fh: FleetHome, edge: str, model: str, *, agree: bool) -> None:
    rows = fh.db.query(
        "SELECT prediction_id, decision FROM predictions WHERE edge=? AND model=?", (edge, model)
    )
    with fh.fleet() as fleet:
        for row in rows:
            reject = (row["decision"] == "reject") == agree
            fleet.add_label(row["prediction_id"], "scratch" if reject else "clean", "test")


def test_a_good_model_completes_wave_by_wave_with_the_recommended_thresholds(
    plant: Plant,
) -> None:
    fh = plant.fh
    bless(fh, GOOD, recommended=0.35)
    rollout_id = start(
        fh,
        f"inspect:{GOOD}",
        canary=["st-03"],
        waves="50%,100%",
        health_window="1s",
        abort_if="failed_activation>0,latency_p95_ms>5000",
    )
    wait_state(fh, rollout_id, "completed", timeout_s=60)
    edges = edge_rows(fh, rollout_id)
    assert {r["wave"] for r in edges.values()} == {0, 1, 2}
    moved = sorted(edges.values(), key=lambda r: float(r["moved_at"]))
    assert [r["edge"] for r in moved] == ["st-03", "st-01", "st-02"]  # canary first
    kinds = [
        r["kind"]
        for r in fh.db.query(
            "SELECT kind FROM rollout_events WHERE rollout_id=? ORDER BY rowid", (rollout_id,)
        )
    ]
    assert kinds.count("wave") == 3 and kinds[-1] == "completed" and "aborted" not in kinds
    for edge in EDGES:
        wait_until(
            partial(fh.edge_row, edge),
            30,
            f"{edge} on inspect:{GOOD}",
            expect=lambda r: r.get("serving") == f"inspect:{GOOD}",
        )
        config = desired_config(fh, edge)
        assert (config["model"], config["threshold"]) == (f"inspect:{GOOD}", 0.35)
        wait_config_applied(fh, edge, config["version"])


def test_an_offline_edge_times_out_and_the_rollout_still_ends(plant: Plant) -> None:
    fh = plant.fh
    bless(fh, GOOD)
    # It never settles: a failed activation after 2 s, whatever --abort-if says; it never
    # confirms the rollback either: given up on after 2 s more.
    rollout_id = start(
        fh,
        f"inspect:{GOOD}",
        (OFFLINE,),
        waves="100%",
        health_window="1s",
        abort_if="latency_p95_ms>5000",
        activation_timeout="2s",
        rollback_timeout="2s",
    )
    wait_state(fh, rollout_id, "rolled_back")
    row = rollout_row(fh, rollout_id)
    assert row["finished_at"] is not None
    assert row["reason"].startswith(
        f"{OFFLINE}: failed_activation=1 (not settled within the 2s activation timeout)"
    )
    assert f"not confirmed back: {OFFLINE}" in row["reason"]
    assert edge_rows(fh, rollout_id)[OFFLINE]["state"] == "unconfirmed"
    unconfirmed = fh.db.query(
        "SELECT edge FROM rollout_events WHERE rollout_id=? AND kind='unconfirmed'", (rollout_id,)
    )
    assert [r["edge"] for r in unconfirmed] == [OFFLINE]
    assert deployed_versions(fh, OFFLINE)[-2:] == [GOOD, 1]  # moved, then sent back

    # A long rollback timeout: `abort --force` ends the wait instead.
    waiting = start(
        fh,
        f"inspect:{GOOD}",
        (OFFLINE,),
        waves="100%",
        abort_if="failed_activation>0",
        activation_timeout="1s",
        rollback_timeout="1h",
    )
    wait_state(fh, waiting, "aborted")
    assert rollout_row(fh, waiting)["finished_at"] is None
    with fh.fleet() as fleet:
        with pytest.raises(RolloutError, match="already aborted and waits for st-04"):
            Rollouts(fleet).abort(waiting, time.time())
        ended = Rollouts(fleet).abort(waiting, time.time(), force=True)
    assert ended.state is RolloutState.ROLLED_BACK and ended.unconfirmed == (OFFLINE,)
    assert rollout_row(fh, waiting)["finished_at"] is not None
    kinds = [
        r["kind"]
        for r in fh.db.query(
            "SELECT kind FROM rollout_events WHERE rollout_id=? ORDER BY rowid", (waiting,)
        )
    ]
    assert "forced" in kinds and kinds[-1] == "rolled_back"

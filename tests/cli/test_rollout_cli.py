"""``fedge rollout`` with ``fedge manager serve`` as a process: a serve SIGKILLed in the
middle of a rollout resumes it after a restart and completes it; the CLI's bad input is
one red line and starts nothing. Real Mosquitto, real agents, real processes."""

import json
import re
import time
from pathlib import Path

import pytest
from conftest import (
    FleetHome,
    Proc,
    Processes,
    deploy,
    make_fleet_home,
    publish_model,
    wait_deploy_done,
    wait_until,
)

pytestmark = pytest.mark.integration
EDGES = ("st-01", "st-02")


def _serve(processes: Processes, tmp_path: Path, name: str) -> Proc:
    ready = tmp_path / f"{name}.ready"
    serve = processes.start(name, "manager", "serve", "--ready-file", str(ready))
    wait_until(ready.exists, 30, f"{name} to be ready")
    return serve


def _state(fh: FleetHome, rollout_id: str) -> str:
    return str(fh.row("SELECT state FROM rollouts WHERE rollout_id=?", (rollout_id,))["state"])


def test_a_killed_serve_resumes_the_rollout(tmp_path: Path, processes: Processes) -> None:
    fh = make_fleet_home(tmp_path, edges=EDGES)
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    broker = fh.broker()
    broker.start()
    try:
        publish_model(fh, 1, seed=1)
        publish_model(fh, 2, seed=2)
        fh.db.conn.execute(
            "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
            "VALUES ('inspect', 2, 1, ?, 'e-test', ?)",
            (json.dumps({"recommended_thresholds": {"default_threshold": 0.4}}), time.time()),
        )
        serve = _serve(processes, tmp_path, "serve")
        for edge in EDGES:
            # A rollout's waves wait for each station's probation verdict: 2 s, not 10 min.
            fh.set_agent_option(edge, "probation_s", 2.0)
            processes.start(edge, "agent", "run", "--config", str(fh.agents[edge]))
        deployment = deploy(fh, 1, EDGES)
        for edge in EDGES:
            assert wait_deploy_done(fh, deployment, edge)["deploy_stage"] == "active"

        # -- bad input: one red line each, nothing started
        bad = processes.cli(
            "rollout", "start", "inspect:2", "--abort-if", "error_rate<0.1", expect=1
        )
        assert "comparison '<' is not supported" in bad.stderr and "Traceback" not in bad.stderr
        unblessed = processes.cli("rollout", "start", "inspect:1", expect=1)
        assert "inspect:1 was never gated; nothing was started" in " ".join(
            unblessed.stderr.split()
        )
        assert fh.db.scalar("SELECT count(*) FROM rollouts") == 0

        started = processes.cli(
            "rollout",
            "start",
            "inspect:2",
            "--edges",
            "all",
            "--canary",
            "st-01",
            "--waves",
            "100%",
            "--health-window",
            "6s",
            "--abort-if",
            "failed_activation>0",
        )
        found = re.search(r"rollout (r-[0-9a-f]+)", started.stdout)
        assert found is not None, started.stdout
        rollout_id = found.group(1)

        # -- the canary moves; serve dies before its health window is over
        wait_until(
            lambda: fh.edge_row("st-01"),
            30,
            "st-01 on inspect:2",
            expect=lambda r: r.get("serving") == "inspect:2",
        )
        processes.kill(serve)
        assert _state(fh, rollout_id) == "canary"
        assert fh.edge_row("st-02")["serving"] == "inspect:1"

        # -- a new serve picks the rollout up where it was and completes it
        _serve(processes, tmp_path, "serve-again")
        wait_until(
            lambda: _state(fh, rollout_id),
            40,
            "the rollout to complete",
            expect=lambda s: s == "completed",
        )
        wait_until(
            lambda: fh.edge_row("st-02"),
            30,
            "st-02 on inspect:2",
            expect=lambda r: r.get("serving") == "inspect:2",
        )
        # Each edge was moved exactly once (no second deployment after the restart).
        moves = fh.db.query(
            "SELECT edge FROM rollout_events WHERE rollout_id=? AND kind='moved' ORDER BY edge",
            (rollout_id,),
        )
        assert [m["edge"] for m in moves] == list(EDGES)

        view = json.loads(processes.cli("rollout", "status", rollout_id, "--json").stdout)
        assert view["state"] == "completed" and view["label"] == "completed"
        assert [(e["edge"], e["wave"], e["state"]) for e in view["edges"]] == [
            ("st-01", 0, "moved"),
            ("st-02", 1, "moved"),
        ]
        shown = processes.cli("rollout", "status").stdout  # the newest by default
        assert rollout_id in shown and "completed" in shown and "canary" in shown
        listed = processes.cli("rollout", "list").stdout
        assert rollout_id in listed and "2/2" in listed

        late = processes.cli("rollout", "pause", rollout_id, expect=1)
        assert "is completed; only a pending or moving rollout can be paused" in " ".join(
            late.stderr.split()
        )
        missing = processes.cli("rollout", "abort", "r-nothing", expect=1)
        assert "no rollout 'r-nothing'" in missing.stderr
    finally:
        processes.close()
        broker.stop()
        fh.close()

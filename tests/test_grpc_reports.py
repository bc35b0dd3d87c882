"""A station whose records go over gRPC (``report_via = "grpc"``), with real processes.

Managed broker (configs and deployments still arrive over MQTT), ``manager serve`` and an
agent process reporting through ``ReportUpload``: every prediction it scores is stored
once at the manager, also across a SIGKILL of the manager in the middle of the stream.
"""

import signal
from pathlib import Path

import pytest
from conftest import (
    Processes,
    deploy,
    drop_images,
    make_fleet_home,
    port_open,
    publish_model,
    wait_deploy_done,
    wait_until,
)

pytestmark = pytest.mark.integration

EDGE = "st-01"


def test_predictions_reported_over_grpc_are_stored_once(
    tmp_path: Path, processes: Processes
) -> None:
    fh = make_fleet_home(tmp_path, edges=(EDGE,))
    processes.env["FEDGE_HOME"] = str(fh.home.root)
    config = fh.agents[EDGE]
    config.write_text(config.read_text() + 'report_via = "grpc"\n')
    publish_model(fh, 1)
    processes.pidfiles.append(fh.home.root / "broker" / "mosquitto.pid")
    processes.start("broker", "manager", "broker")
    wait_until(lambda: port_open(fh.settings.broker_port), 15, "the managed broker to listen")
    ready = tmp_path / "serve.ready"
    serve = processes.start("serve", "manager", "serve", "--ready-file", str(ready))
    agent = processes.start(EDGE, "agent", "run", "--config", str(config))
    try:
        wait_until(ready.exists, 30, "manager serve to be ready")
        row = wait_deploy_done(fh, deploy(fh, 1, [EDGE]), EDGE)
        assert row["deploy_stage"] == "active", row

        def stored() -> int:
            return int(fh.db.scalar("SELECT count(*) FROM predictions WHERE edge=?", (EDGE,)))

        drop_images(fh.inbox(EDGE), "first", 20, seed=1)
        wait_until(stored, 60, "20 predictions over gRPC", expect=lambda n: n == 20)
        # The manager dies mid-stream and comes back: the agent's outbox keeps the rest.
        drop_images(fh.inbox(EDGE), "second", 30, seed=2)
        processes.signal(serve, signal.SIGKILL)
        serve.popen.wait()
        ready.unlink()
        processes.start("serve", "manager", "serve", "--ready-file", str(ready))
        wait_until(stored, 90, "all 50 predictions over gRPC", expect=lambda n: n == 50)
        ids = fh.db.query("SELECT prediction_id, count(*) AS n FROM predictions GROUP BY 1")
        assert len(ids) == 50 and all(r["n"] == 1 for r in ids)
        gaps = fh.db.scalar("SELECT count(*) FROM gaps WHERE edge=?", (EDGE,))
        assert gaps == 0
        assert agent.running(), agent.output()
    except BaseException:
        for proc in processes.procs:
            print(proc.output()[-3000:])
        raise

"""The agent says where its API is and logs its broker connection to a file (issue 15)."""

from pathlib import Path

import pytest
from conftest import Processes, free_port, make_fleet_home, wait_until

pytestmark = pytest.mark.integration
EDGE = "st-01"


def test_the_agent_logs_connection_changes_to_its_file(
    tmp_path: Path, processes: Processes
) -> None:
    fh = make_fleet_home(tmp_path, edges=(EDGE,))
    port = free_port()
    fh.set_agent_option(EDGE, "http_port", port)
    log_file = tmp_path / "agent-logs" / "agent.log"
    broker = fh.broker()
    broker.start()
    try:
        agent = processes.start(
            EDGE, "agent", "run", "--config", str(fh.agents[EDGE]), "--log-file", str(log_file)
        )
        wait_until(lambda: f"http://127.0.0.1:{port}" in agent.output(), 30, "the start-up line")
        wait_until(lambda: "connected" in log_file.read_text(), 30, "the connection logged")
        broker.stop()
        wait_until(lambda: "connection lost" in log_file.read_text(), 30, "the loss logged")
        broker.start()
        wait_until(lambda: "reconnected after" in log_file.read_text(), 60, "the reconnection")
    finally:
        broker.stop()
        fh.close()
    text = log_file.read_text()
    assert f"mqtt {EDGE} -> 127.0.0.1:{fh.settings.broker_port}" in text
    key_body = fh.tls_files(EDGE).key.read_text().splitlines()[1]
    assert key_body not in text and "PRIVATE KEY" not in text

"""The agent's SuperNode supervisor: its node config, restarts, and start failures."""

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

from fedge.edge_agent.training.supervisor import SupernodeSpec, SupernodeSupervisor, node_config

SPEC = SupernodeSpec("127.0.0.1:9", "st-01", Path('/srv/a b\\c "d"'), 20, 2, 90.0)


def test_the_node_config_reaches_flower_intact(tmp_path: Path) -> None:
    path = tmp_path / "node-config.toml"
    path.write_text(node_config(SPEC), encoding="utf-8")
    assert parse_config_args([str(path)]) == {
        "edge": "st-01",
        "data-dir": '/srv/a b\\c "d"',
        "holdout-percent": 20,
        "threads": 2,
        "max-seconds": 90.0,
        "privacy-floor": "none",
    }
    floored = node_config(replace(SPEC, privacy_floor=True))
    assert '"privacy-floor" = "required"' in floored


def wait_for(condition: object, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.integration
def test_a_dying_supernode_is_restarted_and_a_failing_start_is_retried(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "flower-supernode"
    fake.write_text("#!/bin/sh\nexit 3\n")  # not executable yet: the start fails
    supervisor = SupernodeSupervisor(tmp_path / "work", bin_dir=bin_dir)
    supervisor.start()
    try:
        supervisor.apply(SPEC)
        wait_for(lambda: "cannot start" in supervisor.last_error)
        assert supervisor.status()["enabled"] and not supervisor.status()["running"]
        os.chmod(fake, 0o755)  # now it starts, and exits at once: restarted with back-off
        wait_for(lambda: supervisor.starts >= 2)
        assert "exited with code 3" in supervisor.last_error
        supervisor.apply(None)
        wait_for(lambda: not supervisor.status()["running"])
    finally:
        supervisor.stop()

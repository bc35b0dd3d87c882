"""A mixed fleet (issue 27, item 4): today's manager with an agent of the previous release.

The previous release is commit 221958da (before schema versions and the layout of issue
26), taken from this repository with ``git archive`` and run with its ``src`` first on
PYTHONPATH, against a real Mosquitto and today's ``fedge manager serve``, beside an agent
of today. Both take the deployment and a threshold and report every prediction once.
Then the old station is upgraded in place: today's agent opens the old agent's files
(upgrading agent.db) and goes on where it stopped, nothing lost or stored twice.
"""

import sqlite3
import subprocess
import tarfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from conftest import (
    FleetHome,
    Processes,
    count_predictions,
    deploy,
    done_count,
    drop_images,
    make_fleet_home,
    publish_model,
    set_threshold,
    wait_config_applied,
    wait_deploy_done,
    wait_until,
)

from fedge.edge_agent.store import SCHEMA_VERSION

pytestmark = pytest.mark.integration

PREVIOUS_RELEASE = "221958da176e71c5ac657350e497958712b4d2b4"
REPO = Path(__file__).resolve().parents[1]
NEW, OLD = "st-01", "st-02"


def _previous_release_src(into: Path) -> Path:
    into.mkdir(parents=True)
    archive = into / "previous.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "--output", str(archive), PREVIOUS_RELEASE, "src"],
        check=True,
        capture_output=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    src = into / "src"
    assert (src / "fedge" / "edge_agent" / "local_store.py").is_file()  # the old layout
    return src


@pytest.fixture()
def fleet(tmp_path: Path) -> Iterator[tuple[FleetHome, Processes, Processes]]:
    old_src = _previous_release_src(tmp_path / "previous")
    fh = make_fleet_home(tmp_path / "fleet", edges=(NEW, OLD))
    today = Processes(tmp_path / "logs")
    previous = Processes(tmp_path / "logs-previous", env={"PYTHONPATH": str(old_src)})
    broker = fh.broker()
    try:
        broker.start()
        ready = tmp_path / "serve.ready"
        today.start(
            "serve", "manager", "serve", "--home", str(fh.home.root), "--ready-file", str(ready)
        )
        wait_until(ready.exists, 30, "manager serve to be ready", expect=bool)
        yield fh, today, previous
    finally:
        previous.close()
        today.close()
        broker.stop()
        fh.close()


def _stored(fh: FleetHome, edge: str, n: int) -> None:
    wait_until(
        partial(count_predictions, fh, edge),
        60,
        f"{n} predictions of {edge}, each once",
        expect=lambda c: c == {"n": n, "ids": n, "sources": n},
    )


@pytest.mark.timeout(300)
def test_an_agent_of_the_previous_release_works_with_todays_manager_and_upgrades(
    fleet: tuple[FleetHome, Processes, Processes],
) -> None:
    fh, today, previous = fleet
    version = previous.cli("--help").stdout
    assert "Usage" in version
    publish_model(fh, 1, seed=1)
    new_agent = today.start(NEW, "agent", "run", "--config", str(fh.agents[NEW]))
    old_agent = previous.start(OLD, "agent", "run", "--config", str(fh.agents[OLD]))
    deployment = deploy(fh, 1, (NEW, OLD))
    for edge, proc in ((NEW, new_agent), (OLD, old_agent)):
        row = wait_deploy_done(fh, deployment, edge, timeout_s=60)
        assert row["deploy_stage"] == "active", proc.output()
    for edge in (NEW, OLD):
        wait_config_applied(fh, edge, set_threshold(fh, edge, 0.7), timeout_s=30)
        drop_images(fh.inbox(edge), "mixed", 12, seed=4)
    for edge in (NEW, OLD):
        _stored(fh, edge, 12)
    assert (
        fh.row("SELECT count(*) AS n FROM predictions WHERE edge=? AND threshold=0.7", (OLD,))["n"]
        == 12
    )

    # The old station is upgraded in place: today's agent on the same config and files.
    previous.stop(old_agent, timeout_s=10)
    agent_db = fh.data_dir(OLD) / "agent.db"
    with sqlite3.connect(f"file:{agent_db}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (0,)
    upgraded = today.start(f"{OLD}-upgraded", "agent", "run", "--config", str(fh.agents[OLD]))
    drop_images(fh.inbox(OLD), "upgraded", 6, seed=5)
    wait_until(
        partial(done_count, fh.inbox(OLD), "upgraded"),
        60,
        "the upgraded agent scoring",
        expect=lambda n: n == 6,
    )
    _stored(fh, OLD, 18)
    assert upgraded.running(), upgraded.output()
    with sqlite3.connect(f"file:{agent_db}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)

"""A full disk at the manager loses nothing (issue 33), on a real full file system.

The manager's home -- its store, its broker's save file, serve.json -- is a small tmpfs,
filled to the last byte with a ballast file while two real agents stream predictions
(one per MQTT message, so the outage holds hundreds of them) to a real Mosquitto and a
real ``fedge manager serve``. Then the ballast goes, and nothing is restarted.
"""

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    FLEET,
    FleetHome,
    Proc,
    Processes,
    agent_status,
    count_predictions,
    deploy,
    done_count,
    drop_images,
    free_port,
    make_fleet_home,
    publish_model,
    wait_deploy_done,
    wait_until,
)

from fedge.bench.chaos.injector import fill_disk
from fedge.protocols.config import EdgeConfig
from fedge.transport.broker import MosquittoBroker

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02")
TMPFS_MB = 24
# Predictions each station records while the disk is full: one MQTT message each, so
# together more than Mosquitto's in-flight window of 200.
DURING_OUTAGE = 160
# The gap must close within this long of space returning (the target).
CLOSE_WITHIN_S = 30.0


def _mount_tmpfs(path: Path, size_mb: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
        check=True,
        capture_output=True,
    )


def _umount(path: Path) -> None:
    for args in (["umount", str(path)], ["umount", "-l", str(path)]):
        if subprocess.run(args, capture_output=True, check=False).returncode == 0:
            return


def _config_version(http_port: int) -> Any:
    return agent_status(http_port)["config_version"]


@dataclass
class Plant:
    fh: FleetHome
    broker: MosquittoBroker
    processes: Processes
    serve: Proc
    http_ports: dict[str, int]
    dropped: dict[str, int]  # images given to each station so far

    @property
    def ballast(self) -> Path:
        return self.fh.home.root / "ballast"

    def status(self, edge: str) -> dict[str, Any]:
        return agent_status(self.http_ports[edge])

    def backlog(self, edge: str) -> Any:
        return self.status(edge)["backlog"]

    def drop(self, edge: str, prefix: str, count: int) -> None:
        drop_images(self.fh.inbox(edge), prefix, count, seed=sum(map(ord, prefix + edge)))
        self.dropped[edge] += count

    def wait_scored_and_sent(self, prefix: str, count: int, timeout_s: float = 90.0) -> None:
        """Every station scored ``count`` images of ``prefix`` and the broker acknowledged
        every batch (the outbox is empty: the station considers them delivered)."""
        for edge in EDGES:
            wait_until(
                partial(done_count, self.fh.inbox(edge), prefix),
                timeout_s,
                f"{edge} to score {count} images of {prefix}",
                expect=lambda n: n == count,
            )
            wait_until(
                partial(self.backlog, edge),
                timeout_s,
                f"{edge}'s outbox acknowledged by the broker",
                expect=lambda b: b == {"pending_records": 0, "outbox_batches": 0},
            )

    def stored(self) -> dict[str, dict[str, int]]:
        return {edge: count_predictions(self.fh, edge) for edge in EDGES}

    def expected(self) -> dict[str, dict[str, int]]:
        return {edge: {"n": n, "ids": n, "sources": n} for edge, n in self.dropped.items()}

    def gaps(self) -> list[dict[str, Any]]:
        return self.fh.db.query("SELECT * FROM gaps")

    def serve_log(self) -> str:
        return self.serve.output()

    def manager_status(self) -> dict[str, Any]:
        result = self.processes.cli("manager", "status", "--home", str(self.fh.home.root), "--json")
        data: dict[str, Any] = json.loads(result.stdout)
        return data


@pytest.fixture(scope="module")
def plant(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plant]:
    root = tmp_path_factory.mktemp("full-disk")
    mount = root / "home"
    _mount_tmpfs(mount, TMPFS_MB)
    processes = Processes(root / "logs")
    broker: MosquittoBroker | None = None
    fh: FleetHome | None = None
    try:
        fh = make_fleet_home(root, edges=EDGES)
        assert fh.home.root == mount
        ports = {edge: free_port() for edge in EDGES}
        for edge in EDGES:
            fh.set_agent_option(edge, "http_port", ports[edge])
        broker = fh.broker()
        broker.start()
        ready = root / "serve.ready"
        serve = processes.start(
            "serve", "manager", "serve", "--home", str(mount), "--ready-file", str(ready)
        )
        wait_until(ready.exists, 30, "manager serve to be ready", expect=bool)
        publish_model(fh, 1, seed=1)
        agents = {
            e: processes.start(e, "agent", "run", "--config", str(fh.agents[e])) for e in EDGES
        }
        deployment = deploy(fh, 1, EDGES)
        for edge in EDGES:
            row = wait_deploy_done(fh, deployment, edge)
            assert row["deploy_stage"] == "active", agents[edge].output()
        # One record per batch: every prediction is one MQTT message.
        with fh.fleet() as fleet:
            for edge in EDGES:
                version = fleet.push_config(
                    EdgeConfig(FLEET, edge, version=1, batch_max_records=1), time.time()
                ).version
                assert version == 1
        for edge in EDGES:
            wait_until(
                partial(_config_version, ports[edge]),
                20,
                f"{edge} to apply one record per batch",
                expect=lambda v: v == 1,
            )
        yield Plant(fh, broker, processes, serve, ports, dict.fromkeys(EDGES, 0))
    finally:
        processes.close()
        if broker is not None:
            broker.stop()
        if fh is not None:
            fh.close()
        _umount(mount)


def _outage(plant: Plant, prefix: str) -> None:
    """Fill the home's file system and have each station record DURING_OUTAGE
    predictions, every one acknowledged by the broker; check serve said so once."""
    taken = fill_disk(plant.ballast)
    assert taken > 0
    before = plant.stored()
    for edge in EDGES:
        plant.drop(edge, prefix, DURING_OUTAGE)
    plant.wait_scored_and_sent(prefix, DURING_OUTAGE)
    status = wait_until(
        plant.manager_status,
        15,
        "manager status to say the store is unwritable",
        expect=lambda s: s["store"] == "unwritable",
    )
    assert "full" in status["store_detail"], status
    # Stored nothing of the outage's batches beyond what fit before the disk filled.
    assert all(plant.stored()[e]["n"] < plant.dropped[e] for e in EDGES), (before, plant.stored())


def _space_returns_and_gap_closes(plant: Plant) -> float:
    plant.ballast.unlink()
    freed = time.monotonic()
    wait_until(
        lambda: (plant.stored(), plant.gaps()),
        CLOSE_WITHIN_S,
        "every recorded prediction stored once and no open gap after space returned",
        expect=lambda got: got == (plant.expected(), []),
    )
    return time.monotonic() - freed


@pytest.mark.timeout(300)
def test_full_disk_holds_every_message_and_the_gap_closes_by_itself(plant: Plant) -> None:
    for edge in EDGES:
        plant.drop(edge, "warm", 10)
    plant.wait_scored_and_sent("warm", 10)
    wait_until(plant.stored, 20, "warm-up stored", expect=lambda s: s == plant.expected())

    _outage(plant, "full")
    # More than the broker's in-flight window of 200 wait at the manager, unacknowledged.
    status = wait_until(
        plant.manager_status,
        15,
        "serve to hold every message of the outage",
        expect=lambda s: s["held"] is not None and s["held"] > 200,
    )
    assert status["store"] == "unwritable"
    took = _space_returns_and_gap_closes(plant)
    assert took < CLOSE_WITHIN_S
    log = plant.serve_log()
    assert log.count("store unwritable:") == 1, log[-4000:]
    assert log.count("store writable again") == 1, log[-4000:]
    assert "message(s) waited" in log
    assert "Traceback" not in log, log[-4000:]
    wait_until(
        plant.manager_status, 10, "status to say the store is ok", expect=lambda s: s["held"] == 0
    )

    # Ingest from the stations carries on afterwards, nothing restarted.
    for edge in EDGES:
        plant.drop(edge, "after", 5)
    plant.wait_scored_and_sent("after", 5)
    wait_until(plant.stored, 20, "ingest after the outage", expect=lambda s: s == plant.expected())
    assert plant.serve.running(), plant.serve_log()


@pytest.mark.timeout(300)
def test_broker_restarted_during_the_outage_loses_nothing_acknowledged(plant: Plant) -> None:
    _outage(plant, "restart")
    # The broker's own save fails on the same full disk; it restarts from an older one.
    plant.broker.stop()
    plant.broker.start()
    broker_log = plant.broker.log_path.read_text(errors="replace")
    assert "No space left on device" in broker_log or "Error saving" in broker_log, broker_log
    # doctor says both: the store holds messages, the broker could not save.
    home = str(plant.fh.home.root)
    result = plant.processes.cli("manager", "doctor", "--home", home, "--json", expect=1)
    errors = {
        f["check"]: f["message"]
        for f in json.loads(result.stdout)["findings"]
        if f["severity"] == "error"
    }
    assert set(errors) == {"store-space", "broker-save"}, errors
    assert "the store is unwritable" in errors["store-space"]
    assert "could not write its save file" in errors["broker-save"]
    _space_returns_and_gap_closes(plant)
    assert plant.serve.running(), plant.serve_log()


def test_serve_refuses_a_store_it_cannot_write(plant: Plant, tmp_path: Path) -> None:
    """A second home on a full tmpfs: `manager serve` says why and exits 1."""
    mount = tmp_path / "full"
    _mount_tmpfs(mount, 2)
    try:
        fh = make_fleet_home(mount, edges=())
        fill_disk(mount / "ballast")
        result = plant.processes.cli("manager", "serve", "--home", str(fh.home.root), expect=1)
        message = " ".join((result.stdout + result.stderr).split())
        assert "cannot serve: the store" in message, message
        assert "No space left on device" in message, message
        assert "free space on that file system" in message, message
        fh.close()
    finally:
        _umount(mount)
    assert os.path.exists(tmp_path)

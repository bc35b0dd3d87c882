"""A full disk at the manager loses nothing (issue 33), on a real full file system.

The manager's home -- its store, its broker's save file, serve.json -- is a small tmpfs,
filled to the last byte with a ballast file while two real agents stream predictions
(one per MQTT message, so the outage holds hundreds of them) to a real Mosquitto and a
real ``fedge manager serve``. Then the ballast goes, and nothing is restarted.
"""

import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
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
    # Said once every held message is stored: the predictions may be in before the
    # telemetry held behind them, so the line can trail the gap's closing.
    log = wait_until(
        plant.serve_log, 30, "the recovery line", expect=lambda text: "store writable again" in text
    )
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


def _metric_gaps(fh: FleetHome, edge: str, since: float) -> list[float]:
    """Seconds between the station's successive metric reports after ``since`` (its own
    clock: when each was emitted, not when it arrived)."""
    rows = fh.db.query(
        "SELECT at FROM telemetry WHERE edge=? AND name='predictions' AND at > ? ORDER BY at",
        (edge, since),
    )
    ats = [float(row["at"]) for row in rows]
    return [later - earlier for earlier, later in itertools.pairwise(ats)]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@pytest.mark.timeout(300)
def test_low_space_slows_the_fleets_telemetry_not_its_predictions(tmp_path: Path) -> None:
    """Under the headroom (8 MiB here) the manager asks the station for metrics 6x less
    often and back to normal once space returns; predictions keep flowing meanwhile."""
    edge = "st-01"
    mount = tmp_path / "home"
    _mount_tmpfs(mount, TMPFS_MB)
    processes = Processes(tmp_path / "logs")
    broker: MosquittoBroker | None = None
    fh: FleetHome | None = None
    try:
        fh = make_fleet_home(tmp_path, edges=(edge,))
        fh.home.save_settings(replace(fh.home.settings(), low_space_percent=0.0, low_space_mib=8.0))
        port = free_port()
        fh.set_agent_option(edge, "http_port", port)
        broker = fh.broker()
        broker.start()
        ready = tmp_path / "serve.ready"
        serve = processes.start(
            "serve", "manager", "serve", "--home", str(mount), "--ready-file", str(ready)
        )
        wait_until(ready.exists, 30, "manager serve to be ready", expect=bool)
        publish_model(fh, 1, seed=1)
        agent = processes.start(edge, "agent", "run", "--config", str(fh.agents[edge]))
        row = wait_deploy_done(fh, deploy(fh, 1, [edge]), edge)
        assert row["deploy_stage"] == "active", agent.output()
        with fh.fleet() as fleet:
            fleet.push_config(
                EdgeConfig(FLEET, edge, version=1, report_interval_s=0.5), time.time()
            )
        wait_until(partial(_config_version, port), 20, "the config", expect=lambda v: v == 1)
        normal_from = time.time()
        time.sleep(4)
        assert _median(_metric_gaps(fh, edge, normal_from)) < 1.5

        # Low, not full: leave 4 MiB of the 24 (the store keeps writing).
        ballast = mount / "ballast"
        ballast.write_bytes(b"\0" * (shutil.disk_usage(mount).free - 4 * 1024 * 1024))
        pace = wait_until(
            lambda: agent_status(port)["telemetry_pace"],
            20,
            "the station to be asked for telemetry less often",
            expect=lambda p: p["factor"] == 6.0,
        )
        assert "short of space" in pace["reason"], pace
        slowed_from = time.time()
        drop_images(fh.inbox(edge), "low", 20, seed=7)
        wait_until(
            lambda: count_predictions(fh, edge)["n"],
            60,
            "the predictions made while space is low stored at their pace",
            expect=lambda n: n == 20,
        )
        time.sleep(max(0.0, slowed_from + 12 - time.time()))
        slowed = _metric_gaps(fh, edge, slowed_from + 0.5)
        assert slowed and _median(slowed) > 2.5, slowed

        ballast.unlink()
        wait_until(
            lambda: agent_status(port)["telemetry_pace"]["factor"],
            20,
            "the station back to the normal telemetry pace",
            expect=lambda f: f == 1.0,
        )
        again_from = time.time()
        time.sleep(5)
        assert _median(_metric_gaps(fh, edge, again_from + 0.5)) < 1.5
        log = serve.output()
        assert log.count("asked 1 station(s) for telemetry 6x less often") == 1, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        processes.close()
        if broker is not None:
            broker.stop()
        if fh is not None:
            fh.close()
        _umount(mount)

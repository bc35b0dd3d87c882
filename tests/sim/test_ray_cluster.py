"""`fedge sim --backend flower --ray-address` on a real two-node Ray cluster (issue 29).

The head node runs on this host; the worker node in its own network namespace (the
conftest's second host, joined by a veth pair), so the two are separate nodes the way a
second machine would be. The same scenario runs through the CLI on the cluster, and the
test watches where Flower's ClientApp actors run: at least one on each node.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest
from conftest import StrangerHost, free_port, stranger_host

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("ray")]

RAY = str(Path(sys.executable).with_name("ray"))
FEDGE = str(Path(sys.executable).with_name("fedge"))
ACTOR = "ray::ClientAppActor"
# Ray waits this long for a node's agents to start; its default fails on a loaded machine.
RAY_ENV = {"RAY_raylet_start_wait_time_s": "180", "RAY_USAGE_STATS_ENABLED": "0"}


@dataclass
class Cluster:
    address: str
    worker: StrangerHost
    temp_dir: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _netns_pids(name: str) -> set[int]:
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return {int(p) for p in done.stdout.split()}


def _ours(temp_dir: str) -> set[int]:
    """Every process of this cluster's nodes: its services name the temp dir, and its
    workers (ray::IDLE, actors) are their children."""
    services = {int(p) for p in os.listdir("/proc") if p.isdigit() and temp_dir in _cmdline(int(p))}
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        ppid = next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), 0
        )
        if ppid in services:
            children.add(int(entry))
    return services | children


def _start(argv: list[str], out: IO[bytes], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # Its own session: the node's services are stopped as a group afterwards.
    return subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _wait_for(path: Path, text: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        time.sleep(1)
    raise AssertionError(
        f"{what} did not start within {timeout_s:.0f}s:\n{path.read_text()[-3000:]}"
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    env = {**os.environ, **RAY_ENV}
    # A short path: Ray's socket names live under it (AF_UNIX paths are 107 bytes at most).
    temp_dir = tempfile.mkdtemp(prefix="fray-", dir="/tmp")
    with stranger_host() as worker:
        port = free_port()
        address = f"{worker.host_ip}:{port}"
        found = Cluster(address, worker, temp_dir)
        head_log, worker_log = tmp_path / "head.log", tmp_path / "worker.log"
        try:
            head = [
                RAY, "start", "--head", "--block", f"--node-ip-address={worker.host_ip}",
                f"--port={port}", "--num-cpus=1", "--num-gpus=0", "--include-dashboard=false",
                f"--temp-dir={temp_dir}", "--disable-usage-stats",
            ]  # fmt: skip
            with head_log.open("wb") as out:
                found.processes.append(
                    subprocess.Popen(
                        head, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
            _wait_for(head_log, "Ray runtime started", 240, "the Ray head node")
            join = [
                "ip", "netns", "exec", worker.name, RAY, "start", "--block",
                f"--address={address}", f"--node-ip-address={worker.ip}", "--num-cpus=1",
                "--num-gpus=0", "--disable-usage-stats",
            ]  # fmt: skip
            with worker_log.open("wb") as out:
                found.processes.append(
                    subprocess.Popen(
                        join, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
            _wait_for(worker_log, "Ray runtime started", 240, "the Ray worker node")
            yield found
        finally:
            members = _ours(temp_dir) | _netns_pids(worker.name)
            for process in found.processes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
            time.sleep(3)
            for pid in members | _ours(temp_dir) | _netns_pids(worker.name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for process in found.processes:
                process.wait(timeout=30)
            subprocess.run(["rm", "-rf", temp_dir], check=False)


@pytest.mark.timeout(1200)
def test_a_scenario_runs_across_both_nodes_of_a_ray_cluster(
    cluster: Cluster, tmp_path: Path
) -> None:
    seen: dict[str, set[int]] = {"worker": set(), "head": set()}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            inside = _netns_pids(cluster.worker.name)
            for pid in inside:
                if _cmdline(pid).startswith(ACTOR):
                    seen["worker"].add(pid)
            for pid in _ours(cluster.temp_dir) - inside:
                if _cmdline(pid).startswith(ACTOR):
                    seen["head"].add(pid)
            stop.wait(1.0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out = tmp_path / "summary.json"
    try:
        command = [
            FEDGE, "sim", "--scenario", "fleet-scale", "--parties", "8", "--rounds", "2",
            "--strategies", "fedavg", "--backend", "flower", "--ray-address", cluster.address,
            "--out", str(tmp_path / "report"), "--json", str(out),
        ]  # fmt: skip
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=1000,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ray_address"] == cluster.address and summary["parties"] == 8
    assert summary["final_accuracy"]["fedavg"] > 0.2  # it trained: 2 rounds from 0.1
    # The run used both nodes: a ClientApp actor on the head and one in the worker's
    # namespace (one CPU each, one actor per CPU).
    assert seen["worker"], "no ClientApp actor ran on the worker node"
    assert seen["head"], "no ClientApp actor ran on the head node"

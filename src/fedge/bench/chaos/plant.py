"""The chaos run's real processes: Mosquitto, ``fedge manager serve``, N ``fedge agent run``.

Everything lives under one work directory: the manager home (its broker's files under
``home/broker``), and a station directory per agent with its agent.toml, its data dir
(some on a small tmpfs of their own, for the disk-full fault) and its logs. Each agent
reaches the broker through its own :class:`~fedge.bench.chaos.proxy.FaultyProxy`; model
downloads go to the manager's gRPC port directly.

The broker runs as a child of this process (:class:`MosquittoBroker`), so it can be
stopped, SIGKILLed and started on the same port; the manager and the agents are
``fedge`` subprocesses in sessions of their own.
"""

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fedge.bench import Progress, no_progress
from fedge.bench.chaos.clock import clock_env, install_shim, set_offset
from fedge.bench.chaos.proxy import FaultyProxy
from fedge.bench.footprint import AgentProcess, fedge_command
from fedge.bench.testbed import BenchError
from fedge.edge_agent import store as local_store
from fedge.edge_agent.deploy import restore
from fedge.edge_manager.fleet.operations import Fleet, opened
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.reports import store as report_store
from fedge.edge_manager.security import enrollment
from fedge.transport.broker import MosquittoBroker
from fedge.transport.ports import free_port

FLEET = "chaos"
MODEL_NAME = "inspect"
CLASSES = ("clean", "scratch")


class ManagerProcess:
    """``fedge manager serve`` in a session of its own; ``start`` again after a kill."""

    def __init__(self, home: Path, log_dir: Path, env: dict[str, str]) -> None:
        self.home = home
        self.log_dir = log_dir
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.ready_file = log_dir / "manager.ready"

    def start(self) -> None:
        self.starts += 1
        self.ready_file.unlink(missing_ok=True)
        log_path = self.log_dir / f"manager-{self.starts}.log"
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    *fedge_command(),
                    "manager",
                    "serve",
                    "--home",
                    str(self.home),
                    "--ready-file",
                    str(self.ready_file),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def ready(self) -> bool:
        return self.alive and self.ready_file.exists()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 15.0) -> bool:
        """SIGTERM; True if it exited in time (False: it had to be SIGKILLed)."""
        if self.process is None or self.process.poll() is not None:
            return True
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            self.kill()
            return False


@dataclass
class Station:
    """One agent: its files, its proxy to the broker, and its current process."""

    edge: str
    root: Path
    config: Path
    data_dir: Path
    http_port: int
    proxy: FaultyProxy
    on_tmpfs: bool
    env: dict[str, str]
    process: AgentProcess | None = None
    starts: int = 0
    inbox_dropped: list[str] = field(default_factory=list)

    @property
    def inbox(self) -> Path:
        return self.data_dir / "inbox"

    @property
    def ballast(self) -> Path:
        return self.data_dir / "ballast.bin"

    @property
    def clock_file(self) -> Path:
        """The agent's wall-clock offset (seconds), read by the clock shim."""
        return self.root / "clock_offset"

    def start(self) -> None:
        self.starts += 1
        self.process = AgentProcess(
            self.config, self.http_port, self.root / f"agent-{self.starts}.log", env=self.env
        )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.process.poll() is None

    def kill(self) -> None:
        if self.process is not None and self.process.process.poll() is None:
            self.process.process.send_signal(signal.SIGKILL)
            self.process.process.wait()

    def stop(self, timeout_s: float = 15.0) -> bool:
        """SIGTERM; True if it exited in time (False: it had to be SIGKILLed)."""
        if self.process is None or self.process.process.poll() is not None:
            return True
        proc = self.process.process
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return False

    @property
    def agent_db(self) -> Path:
        """The agent's own store (local_store's ``read_*`` read it while it runs)."""
        return self.data_dir / "agent.db"

    def kv(self, key: str) -> str | None:
        return local_store.read_value(self.agent_db, key)

    def active_model_path(self) -> Path | None:
        raw = self.kv("active_model")
        return None if raw is None else restore.decode_kept(raw).path


def _mount_tmpfs(path: Path, size_mb: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise BenchError(
            f"cannot mount a {size_mb} MiB tmpfs on {path} for the disk-full fault: "
            f"{result.stderr.strip() or result.returncode}; run as root, or give "
            "--disk-agents 0 to run without disk-full faults"
        )


def _umount(path: Path) -> None:
    for args in (["umount", str(path)], ["umount", "-l", str(path)]):
        if subprocess.run(args, capture_output=True, check=False).returncode == 0:
            return


class ChaosPlant:
    """A manager home with ``n_agents`` enrolled, their stations, proxies and processes."""

    def __init__(
        self,
        root: Path,
        n_agents: int,
        *,
        disk_agents: int,
        disk_mb: int = 48,
        manager_disk_mb: int = 0,
        progress: Progress = no_progress,
    ) -> None:
        self.root = root
        self.progress = progress
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLWR_TELEMETRY_ENABLED": "0"}
        self._mounts: list[Path] = []
        # The manager home (store, broker save file, serve.json) on a tmpfs of its own:
        # the manager_disk_full fault fills it (issue 33).
        self.manager_disk = manager_disk_mb > 0
        if self.manager_disk:
            _mount_tmpfs(root / "home", manager_disk_mb)
            self._mounts.append(root / "home")
        self.home = ManagerHome(root / "home")
        self.home.init(
            ManagerSettings(
                FLEET, broker_port=free_port(), grpc_port=free_port(), superlink_port=free_port()
            )
        )
        self.settings = self.home.settings()
        self.stations: dict[str, Station] = {}
        self._shim = install_shim(root / "clockshim")
        progress(f"enrolling {n_agents} edges")
        with self.fleet() as fleet:
            for index in range(n_agents):
                self._add_station(fleet, f"c{index:02d}", index < disk_agents, disk_mb)
        self.broker: MosquittoBroker = enrollment.managed_broker(self.home)
        self.manager = ManagerProcess(self.home.root, root / "logs", self.env)
        (root / "logs").mkdir(exist_ok=True)

    def _add_station(self, fleet: Fleet, edge: str, on_tmpfs: bool, disk_mb: int) -> None:
        station_dir = self.root / "stations" / edge
        data_dir = station_dir / "data"
        station_dir.mkdir(parents=True)
        if on_tmpfs:
            _mount_tmpfs(data_dir, disk_mb)
            self._mounts.append(data_dir)
        text = enrollment.enroll(self.home, fleet, edge, data_dir)
        proxy = FaultyProxy(self.settings.broker_host, self.settings.broker_port, f"proxy-{edge}")
        http_port = free_port()
        replaced = {"broker_port": str(proxy.port), "http_port": str(http_port)}
        lines = [
            f"{key} = {replaced[key]}" if key in replaced else line
            for line in text.splitlines()
            for key in [line.split(" =")[0]]
        ]
        config = station_dir / "agent.toml"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write("\n".join([*lines, ""]))
        env = clock_env(self.env, self._shim, station_dir / "clock_offset")
        self.stations[edge] = Station(
            edge, station_dir, config, data_dir, http_port, proxy.start(), on_tmpfs, env
        )
        set_offset(self.stations[edge].clock_file, 0.0)

    @property
    def manager_ballast(self) -> Path:
        return self.home.root / "ballast"

    @property
    def edges(self) -> list[str]:
        return sorted(self.stations)

    @property
    def disk_edges(self) -> list[str]:
        return [e for e, s in sorted(self.stations.items()) if s.on_tmpfs]

    @contextmanager
    def fleet(self) -> Iterator[Fleet]:
        """The operator's library view: a store connection for the calling thread only."""
        with opened(self.home) as fleet:
            yield fleet

    @contextmanager
    def reader(self) -> Iterator[report_store.Reader]:
        """The manager's store, read-only (report_store reads it while ``serve`` runs)."""
        with report_store.read_only(self.home.db_path) as conn:
            yield conn

    def wait_manager_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.manager.ready:
            if not self.manager.alive:
                raise BenchError(f"`fedge manager serve` exited; see {self.root / 'logs'}")
            if time.monotonic() > deadline:
                raise BenchError(f"`fedge manager serve` not ready within {timeout_s:.0f}s")
            time.sleep(0.05)

    def stop_processes(self) -> dict[str, bool]:
        """Stop every process (agents first, while the broker takes their goodbye).

        Returns, per process, whether it exited on SIGTERM in time. The stations' file
        systems stay mounted: the end check reads each agent's own store.
        """
        exited: dict[str, bool] = {}
        for edge, station in self.stations.items():
            exited[edge] = station.stop()
            station.proxy.close()
        exited["manager"] = self.manager.stop()
        self.broker.stop()
        return exited

    def close(self) -> None:
        """Stop whatever still runs and unmount the stations' file systems."""
        self.stop_processes()
        for mount in self._mounts:
            _umount(mount)
        self._mounts.clear()

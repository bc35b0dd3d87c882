"""The fleet's Flower SuperLink as a managed process (``fedge manager superlink``).

Flower 1.41 serves the SuperLink's Fleet API (stations' SuperNodes connect to it) and
Control API (``flwr run`` submits jobs to it) over HTTP on one ``--host``/``--port``;
it starts each job's ServerApp through ``flower-superexec`` (found on PATH). Its state
lives in a SQLite file in its work directory, so a restarted SuperLink keeps its runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fedge.aggregator.job_dir import JobError

SUPERLINK = "flower-superlink"


class SuperLinkError(JobError):
    """The SuperLink could not be started or stopped."""


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


class SuperLink:
    """One ``flower-superlink`` process, its database and log in ``workdir``."""

    def __init__(self, workdir: Path, host: str, port: int) -> None:
        self.workdir = workdir
        self.host = host
        self.port = port
        self.bin_dir = Path(sys.executable).parent
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "superlink.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return [
            str(self.bin_dir / SUPERLINK),
            "--insecure",
            "--disable-runtime-dependency-installation",
            "--database",
            str(self.workdir / "superlink.db"),
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]

    def start(self, timeout_s: float = 60.0) -> None:
        if not (self.bin_dir / SUPERLINK).exists():
            raise SuperLinkError(
                f"{SUPERLINK} is not installed in {self.bin_dir} (pip install 'fedge[train]')"
            )
        if port_open(self.host, self.port):
            raise SuperLinkError(f"{self.address} is already in use (another SuperLink?)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        home = self.workdir / "flwr-home"
        home.mkdir(exist_ok=True)
        env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
        }
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        end = time.monotonic() + timeout_s
        while not port_open(self.host, self.port):
            if self._proc.poll() is not None:
                raise SuperLinkError(f"{SUPERLINK} exited at start; see {self.log_path}")
            if time.monotonic() >= end:
                self.stop()
                raise SuperLinkError(f"{SUPERLINK} did not listen within {timeout_s:.0f}s")
            time.sleep(0.1)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

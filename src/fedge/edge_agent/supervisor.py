"""The station's Flower SuperNode, supervised by the agent while training is enabled.

Training runs in processes of its own: ``flower-supernode`` connects to the fleet's
SuperLink and starts a ClientApp process (:mod:`fedge.party.station_app`) per message. The
agent never imports torch or Flower; it starts the SuperNode when its signed config
enables training, restarts it (with back-off) when it dies, and stops it when training
is disabled or the agent stops.

The SuperNode is killed with the agent however the agent dies: it gets ``SIGKILL`` when
its parent dies (Linux ``PR_SET_PDEATHSIG``), and Flower's own SuperExec and ClientApp
processes follow their parent. A pid file lets a restarted agent remove a SuperNode
that outlived it anyway (e.g. on a kernel without the parent-death signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SUPERNODE = "flower-supernode"
_PR_SET_PDEATHSIG = 1
_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
_STABLE_S = 60.0  # a SuperNode up this long resets the back-off


@dataclass(frozen=True)
class SupernodeSpec:
    """Everything the SuperNode's command line depends on (a change restarts it)."""

    superlink: str
    edge: str
    data_dir: Path
    holdout_percent: int
    threads: int
    max_seconds: float


def node_config(spec: SupernodeSpec) -> str:
    """The SuperNode's node config as a TOML document: what the station's ClientApp reads.

    Written to a file (Flower reads ``--node-config FILE.toml``): a data directory with
    spaces, quotes or backslashes survives, where the inline ``k=v`` form would not.
    """
    values: dict[str, str | int | float] = {
        "edge": spec.edge,
        "data-dir": str(spec.data_dir),
        "holdout-percent": spec.holdout_percent,
        "threads": spec.threads,
        "max-seconds": float(spec.max_seconds),
    }
    # JSON strings are TOML basic strings (both escape quotes, backslashes and controls).
    return "".join(f'"{key}" = {json.dumps(value)}\n' for key, value in values.items())


def supernode_command(
    spec: SupernodeSpec, bin_dir: Path, runtime_port: int, node_config_file: Path
) -> list[str]:
    """The ``flower-supernode`` command line for this station (pure)."""
    return [
        str(bin_dir / SUPERNODE),
        "--insecure",
        "--superlink",
        spec.superlink,
        "--host",
        "127.0.0.1",
        "--port",
        str(runtime_port),
        "--node-config",
        str(node_config_file),
    ]


def _load_prctl() -> object | None:
    # Loaded at import: a dlopen between fork and exec of a threaded process can deadlock.
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """A new session, and SIGKILL when the parent goes (Linux: PR_SET_PDEATHSIG).

    The signal follows the *thread* that forked: the supervisor's own thread, which lives
    as long as the agent (it never exits on an error, see ``_loop``).
    """
    os.setsid()
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)  # type: ignore[operator]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (Flower starts its apps in new sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def kill_tree(pid: int) -> None:
    """Stop ``pid`` and its descendants so none can start more, then SIGKILL them all."""
    stopped: set[int] = set()
    for _ in range(5):
        new = [p for p in process_tree(pid) if p not in stopped]
        if not new:
            break
        for member in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member, signal.SIGSTOP)
        stopped.update(new)
    for member in stopped:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


class SupernodeSupervisor:
    """Keeps one SuperNode running while a spec is set; thread-safe."""

    def __init__(self, workdir: Path, *, bin_dir: Path | None = None) -> None:
        self.workdir = workdir
        self.bin_dir = bin_dir or Path(sys.executable).parent
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._spec: SupernodeSpec | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._running_spec: SupernodeSpec | None = None
        self.starts = 0
        self.last_error = ""
        self._started_at = 0.0
        self._thread = threading.Thread(target=self._loop, name="supernode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def pid_file(self) -> Path:
        return self.workdir / "supernode.pid"

    @property
    def log_file(self) -> Path:
        return self.workdir / "supernode.log"

    def available(self) -> bool:
        return (self.bin_dir / SUPERNODE).exists()

    def apply(self, spec: SupernodeSpec | None) -> None:
        """Run a SuperNode for ``spec`` (None: none); a changed spec restarts it."""
        with self._lock:
            self._spec = spec
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._terminate()

    def status(self) -> dict[str, object]:
        proc = self._proc
        return {
            "enabled": self._spec is not None,
            "running": proc is not None and proc.poll() is None,
            "pid": None if proc is None else proc.pid,
            "starts": self.starts,
            "last_error": self.last_error,
        }

    # -- the loop

    def _loop(self) -> None:
        self._remove_leftover()
        failures = 0
        while not self._stopping.is_set():
            with self._lock:
                wanted = self._spec
            proc = self._proc
            if proc is not None and (wanted != self._running_spec):
                log.info("training settings changed: stopping the SuperNode")
                self._terminate()
                proc = None
            if proc is not None and proc.poll() is not None:
                code = proc.returncode
                uptime = time.monotonic() - self._started_at
                self.last_error = f"SuperNode exited with code {code} after {uptime:.0f}s"
                log.error("%s; restarting (see %s)", self.last_error, self.log_file)
                self._proc = None
                failures = 0 if uptime > _STABLE_S else failures + 1
                delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                if self._wake.wait(delay):
                    self._wake.clear()
                continue
            if proc is None and wanted is not None:
                try:
                    self._start(wanted)
                except Exception as exc:  # the loop must outlive any failure
                    self.last_error = f"cannot start the SuperNode: {exc}"
                    log.error("%s; retrying", self.last_error)
                    failures += 1
                    delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                    if self._wake.wait(delay):
                        self._wake.clear()
                    continue
            if self._wake.wait(0.5):
                self._wake.clear()

    def _start(self, spec: SupernodeSpec) -> None:
        if not self.available():
            message = (
                f"training is enabled but {SUPERNODE} is not installed in {self.bin_dir}; "
                "install the training extra: pip install 'fedge[agent-train]'"
            )
            if message != self.last_error:
                log.error(message)
            self.last_error = message
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        home = self.workdir / "flwr-home"
        home.mkdir(exist_ok=True)
        config_file = self.workdir / "node-config.toml"
        tmp = config_file.with_suffix(".tmp")
        tmp.write_text(node_config(spec), encoding="utf-8")
        tmp.replace(config_file)
        command = supernode_command(spec, self.bin_dir, _free_port(), config_file)
        env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
        }
        with open(self.log_file, "ab") as out:
            out.write(f"--- {time.ctime()}: {shlex.join(command)}\n".encode())
            out.flush()
            self._proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_die_with_parent,
            )
        self._running_spec = spec
        self._started_at = time.monotonic()
        self.starts += 1
        self.pid_file.write_text(f"{self._proc.pid}\n")
        log.info("SuperNode started (pid %d) for SuperLink %s", self._proc.pid, spec.superlink)

    def _terminate(self) -> None:
        proc = self._proc
        self._proc = None
        self._running_spec = None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        kill_tree(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()

    def _remove_leftover(self) -> None:
        """A SuperNode a previous agent process left behind (its pid file) is killed."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            cmdline = ""
        if SUPERNODE in cmdline:
            log.warning("killing a SuperNode left by an earlier agent process (pid %d)", pid)
            kill_tree(pid)
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()

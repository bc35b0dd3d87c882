"""``fedge manager up/down/status``: the manager's processes in the background, in order.

Each role runs as its own ``fedge manager <role> --home H`` process in a session of its
own, its output appended to ``<home>/logs/<role>.log`` (and its pid noted in
``<home>/run/<role>.up``, so ``status`` names that log only for the process ``up``
started: one started by hand writes to its terminal); the role's lock
(:mod:`fedge.edge_manager.home.run_dir`) is its pid file, so "running" is what the kernel
says, never a stale pid. Up: the broker, then serve (which reports whether it reached the
broker), then optionally the SuperLink. Down: the reverse, SIGTERM then SIGKILL.
"""

import enum
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home.run_dir import (
    Role,
    ServeState,
    engine_log_paths,
    log_path,
    read_serve_state,
    read_up_marker,
    running,
    write_up_marker,
)

UP_ORDER = (Role.BROKER, Role.SERVE, Role.SUPERLINK)
# A log past this size is moved to <role>.log.1 when `up` starts the role again.
ROTATE_BYTES = 10 * 1024 * 1024


def fedge_command() -> list[str]:
    """This environment's ``fedge`` command (the one running now, if it is a script)."""
    script = Path(sys.executable).parent / "fedge"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from fedge.cli.main import app; app()"]


class Output(enum.Enum):
    """Where a role's own output (its stdout and stderr) goes."""

    LOG = "log"  # `manager up` started it: <home>/logs/<role>.log
    TERMINAL = "terminal"  # started outside `manager up`: whatever it was started from
    NONE = "none"  # not running


@dataclass(frozen=True)
class RoleStatus:
    role: Role
    pid: int | None  # None: not running
    output: Output
    logs: tuple[Path, ...]  # the role's log files that exist and belong to what runs


def role_status(
    root: Path, role: Role, pid: int | None, up_pid: int | None, existing: Collection[Path]
) -> RoleStatus:
    """The role's status from its running pid, the pid `up` last started it as and the log
    files that exist (issue 26: status used to name ``logs/<role>.log`` for a process
    started by hand, which writes to its terminal and has no such file).

    An output log left by an earlier `up` is named only while nothing else runs the role:
    it is then the newest output there is, and never that of a process started by hand.
    """
    output_log = log_path(root, role)
    if pid is None:
        output = Output.NONE
    elif pid == up_pid:
        output = Output.LOG
    else:
        output = Output.TERMINAL
    candidates = engine_log_paths(root, role)
    if output is not Output.TERMINAL:
        candidates = (output_log, *candidates)
    return RoleStatus(role, pid, output, tuple(p for p in candidates if p in existing))


def describe(status: RoleStatus) -> str:
    """One line for `fedge manager status`: running or not, and where its logs are."""
    logs = ", ".join(str(p) for p in status.logs)
    if status.pid is None:
        return "stopped; " + (f"logs of its last run: {logs}" if logs else "no log")
    line = f"running (pid {status.pid})"
    if status.output is Output.LOG:
        if not logs:
            return f"{line}; no log (its log file was removed)"
        return f"{line}; {'logs' if len(status.logs) > 1 else 'log'} {logs}"
    line += ", started outside `manager up`: its output goes to its terminal"
    return f"{line}; also {logs}" if logs else line


def status(root: Path) -> list[RoleStatus]:
    result = []
    for role in UP_ORDER:
        held = running(root, role)
        pid = None if held is None else (held.pid or 0)
        candidates = (log_path(root, role), *engine_log_paths(root, role))
        existing = [p for p in candidates if p.is_file()]
        result.append(role_status(root, role, pid, read_up_marker(root, role), existing))
    return result


def _rotate(path: Path) -> None:
    if path.exists() and path.stat().st_size > ROTATE_BYTES:
        os.replace(path, path.with_name(path.name + ".1"))


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _wait(
    ready: Callable[[], bool],
    popen: subprocess.Popen[bytes],
    timeout_s: float,
    what: str,
    log: Path,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if popen.poll() is not None:
            raise ManagerError(f"{what} exited at start: {_tail(log)} (log: {log})")
        time.sleep(0.05)
    raise ManagerError(f"{what} did not come up within {timeout_s:.0f} s; see {log}")


def start(
    root: Path,
    role: Role,
    fedge: Sequence[str],
    *,
    broker_port: int,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> tuple[int, bool]:
    """Start ``role`` in the background unless it runs; return (pid, started now)."""
    held = running(root, role)
    if held is not None:
        return held.pid or 0, False
    log = log_path(root, role)
    log.parent.mkdir(parents=True, exist_ok=True)
    _rotate(log)
    command = [*fedge, "manager", role.value, "--home", str(root)]
    with log.open("ab") as out:
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        out.flush()
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a Ctrl-C in the operator's shell does not reach it
        )
    write_up_marker(root, role, popen.pid)

    def holds() -> bool:
        now = running(root, role)
        return now is not None and now.pid == popen.pid

    def ready() -> bool:
        if not holds():
            return False
        if role is Role.BROKER:
            return _port_open(broker_port)
        if role is Role.SERVE:
            state = read_serve_state(root)
            return state is not None and state.pid == popen.pid
        return True

    _wait(ready, popen, timeout_s, f"`fedge manager {role.value}`", log)
    return popen.pid, True


def serve_state(root: Path) -> ServeState | None:
    """serve's own account of itself, if the serve that wrote it is the one running."""
    held, state = running(root, Role.SERVE), read_serve_state(root)
    if held is None or state is None or state.pid != held.pid:
        return None
    return state


def stop(root: Path, role: Role, *, timeout_s: float = 15.0) -> int | None:
    """SIGTERM the role's process (SIGKILL after ``timeout_s``); its pid, or None if none ran."""
    held = running(root, role)
    if held is None:
        return None
    if not held.pid:
        raise ManagerError(f"`fedge manager {role.value}` holds its lock but names no pid")
    pid = held.pid
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return pid
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if running(root, role) is None:
                return pid
            time.sleep(0.05)
    raise ManagerError(f"`fedge manager {role.value}` (pid {pid}) did not stop")

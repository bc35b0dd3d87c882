"""The station's Flower SuperNode, supervised by the agent while training is enabled.

Training runs in processes of its own: ``flower-supernode`` connects to the fleet's
SuperLink and starts a ClientApp process (:mod:`fedge.party.station_app`) per message. The
agent never imports torch or Flower; it starts the SuperNode when its signed config
enables training, restarts it (with back-off) when it dies, and stops it when training
is disabled or the agent stops.

On the wire (issue 13) the SuperNode speaks HTTPS to the SuperLink, trusting only the
fleet CA (``--root-certificates``), and signs every request with the station's own key
(``--auth-supernode-private-key``): the SuperLink admits only keys the manager registered,
the public key of the station's certificate. Flower reads that key in OpenSSH format, so
the supervisor writes the same P-256 key re-encoded (0600) beside its state. Without a CA
the SuperNode speaks plain HTTP (``--insecure``), for development only.

When the SuperNode is not on the SuperLink, the supervisor names the cause and what to do
(issue 27, :mod:`fedge.edge_agent.training.causes`): a node still active after a kill
(waited out: Flower releases it within a minute, and the fleet's front usually releases
it at once), a key not registered or revoked, a CA that does not verify the SuperLink, or
the network. Flower's SuperNode keeps retrying a network fault without saying which, so
while it runs the supervisor reads its log every few seconds and, when connection attempts
keep failing, tries the address itself to name the fault (refused, unreachable, timed out).

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
import re
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedge.edge_agent.training.causes import (
    Diagnosis,
    SupernodeCause,
    current_section,
    diagnose,
    with_probe,
)
from fedge.protocols.pki import write_private
from fedge.transport.ports import free_port

log = logging.getLogger(__name__)

SUPERNODE = "flower-supernode"
_PR_SET_PDEATHSIG = 1
_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
_STABLE_S = 60.0  # a SuperNode up this long resets the back-off
_WAIT_OUT_S = 5.0  # retry a refusal that resolves itself (a node still active) this often
_WATCH_S = 5.0  # how often a running SuperNode's log is read for a connection fault
_PROBE_TIMEOUT_S = 5.0
AUTH_KEY_FILE = "node-auth.key"  # the station's key as Flower reads it (OpenSSH)
TRUSTED_ENTITIES_FILE = "trusted-entities.yaml"  # whose signed apps the SuperNode runs
# Flower's exit codes (flwr.supercore.exit.ExitCode) a station's operator must act on;
# the process itself exits 1, Flower's code is in its last log lines ("Exit Code: 305").
_EXIT_HINTS = {
    303: "SuperNode authentication needs TLS (a CA)",
    304: "the trusted-entities file (the manager keys apps must be signed by) is invalid",
    305: "the connection to the SuperLink failed (the lines above it in the SuperNode's "
    "log say why)",
}
_FLOWER_EXIT = re.compile(r"Exit Code: (\d+)")


@dataclass(frozen=True)
class SupernodeSpec:
    """Everything the SuperNode's command line depends on (a change restarts it)."""

    superlink: str
    edge: str
    data_dir: Path
    holdout_percent: int
    threads: int
    max_seconds: float
    # The fleet CA the SuperLink's certificate must chain to; None: plain HTTP (development).
    root_certificates: Path | None = None
    # The station's private key (PEM, P-256: its TLS key) for SuperNode authentication.
    auth_key: Path | None = None
    # Whether agent.toml gives the station a privacy floor (the agent says so): the
    # ClientApp then refuses to train when the floor is missing from the ledger instead of
    # training without it. False only where no agent keeps a ledger (tests, the bench).
    privacy_floor: bool = False
    # Flower's --trusted-entities (YAML): the keys whose signature an app must carry before
    # the SuperNode runs any of it (protocols/app_signing.py). None: any app runs, which
    # only tests of the plain Flower peer ask for.
    trusted_entities: str | None = None

    def __post_init__(self) -> None:
        if self.auth_key is not None and self.root_certificates is None:
            raise ValueError("SuperNode authentication needs TLS: give root_certificates too")


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
        "privacy-floor": "required" if spec.privacy_floor else "none",
    }
    # JSON strings are TOML basic strings (both escape quotes, backslashes and controls).
    return "".join(f'"{key}" = {json.dumps(value)}\n' for key, value in values.items())


def openssh_private_key(key_pem: bytes) -> bytes:
    """The station's EC key (PEM) re-encoded as the OpenSSH private key Flower reads."""
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("SuperNode authentication needs an ECDSA key (fleet keys: P-256)")
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )


def supernode_command(
    spec: SupernodeSpec,
    bin_dir: Path,
    runtime_port: int,
    node_config_file: Path,
    auth_key_file: Path | None = None,
    trusted_entities_file: Path | None = None,
) -> list[str]:
    """The ``flower-supernode`` command line for this station (pure); ``auth_key_file`` is
    ``spec.auth_key`` in OpenSSH format (:func:`openssh_private_key`),
    ``trusted_entities_file`` holds ``spec.trusted_entities``."""
    if (spec.auth_key is None) != (auth_key_file is None):
        raise ValueError("give auth_key_file exactly when the spec has an auth_key")
    if (spec.trusted_entities is None) != (trusted_entities_file is None):
        raise ValueError("give trusted_entities_file exactly when the spec has trusted entities")
    if spec.root_certificates is None:
        security = ["--insecure"]
    else:
        security = ["--root-certificates", str(spec.root_certificates)]
    if auth_key_file is not None:
        security += ["--auth-supernode-private-key", str(auth_key_file)]
    if trusted_entities_file is not None:
        security += ["--trusted-entities", str(trusted_entities_file)]
    return [
        str(bin_dir / SUPERNODE),
        *security,
        "--superlink",
        spec.superlink,
        "--host",
        "127.0.0.1",
        "--port",
        str(runtime_port),
        "--node-config",
        str(node_config_file),
    ]


def exit_reason(log_tail: str) -> str:
    """What Flower's last exit code in a SuperNode's log means (", Flower exit code N:
    why"), or "" when the log names none. Only the last start counts (each start
    writes a ``--- <time>: <command>`` line first)."""
    codes = _FLOWER_EXIT.findall(log_tail.rsplit("\n--- ", 1)[-1])
    if not codes:
        return ""
    code = int(codes[-1])
    return f", Flower exit code {code}" + (f": {_EXIT_HINTS[code]}" if code in _EXIT_HINTS else "")


def probe(superlink: str, root_certificates: Path | None) -> BaseException | None:
    """What connecting to ``superlink`` ("host:port") raises now (TCP, then the TLS
    handshake against ``root_certificates``); None: it connects."""
    host, _, port = superlink.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=_PROBE_TIMEOUT_S) as sock:
            if root_certificates is not None:
                context = ssl.create_default_context(cafile=str(root_certificates))
                with context.wrap_socket(sock, server_hostname=host):
                    pass
    except (OSError, ValueError) as exc:
        return exc
    return None


def _log_tail(path: Path, size: int = 4096) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, path.stat().st_size - size))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


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
        # The cause last named (SupernodeCause's value), "" while none is; for status.
        self.last_cause = ""
        self._reported = ""  # the fault last logged while the SuperNode runs
        self._next_watch = 0.0
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
            "last_cause": self.last_cause,
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
                tail = _log_tail(self.log_file)
                running = self._running_spec
                diagnosis = None
                if running is not None:
                    diagnosis = diagnose(current_section(tail), running.superlink)
                self.last_error = f"SuperNode exited with code {code} after {uptime:.0f}s"
                if diagnosis is not None:
                    self.last_error += f": {diagnosis.message}"
                    self.last_cause = diagnosis.cause.value
                else:
                    self.last_error += exit_reason(tail)
                    self.last_cause = ""
                waits = diagnosis is not None and diagnosis.waits_it_out
                log.log(
                    logging.WARNING if waits else logging.ERROR,
                    "%s; restarting (see %s)",
                    self.last_error,
                    self.log_file,
                )
                self._proc = None
                self._reported = ""
                if waits:
                    # Resolves itself within a minute: retry often, without escalating.
                    delay = _WAIT_OUT_S
                else:
                    failures = 0 if uptime > _STABLE_S else failures + 1
                    delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                if self._wake.wait(delay):
                    self._wake.clear()
                continue
            if proc is not None and time.monotonic() >= self._next_watch:
                self._next_watch = time.monotonic() + _WATCH_S
                self._watch()
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

    def _watch(self) -> None:
        """Name a connection fault of the running SuperNode once (again when it changes),
        and say when it is over."""
        spec = self._running_spec
        if spec is None:
            return
        diagnosis: Diagnosis | None = diagnose(
            current_section(_log_tail(self.log_file)), spec.superlink
        )
        if diagnosis is None:
            if self._reported:
                log.info("the SuperNode reached the SuperLink at %s again", spec.superlink)
                self._reported = ""
                self.last_cause = ""
            return
        diagnosis = with_probe(
            diagnosis, probe(spec.superlink, spec.root_certificates), spec.superlink
        )
        if diagnosis.message != self._reported:
            self._reported = diagnosis.message
            self.last_error = diagnosis.message
            self.last_cause = diagnosis.cause.value
            # A network fault may pass (a warning, as for the broker); anything else
            # (TLS, a key no longer accepted) needs a person.
            network = diagnosis.cause in (SupernodeCause.NETWORK, SupernodeCause.RETRYING)
            log.log(
                logging.WARNING if network else logging.ERROR,
                "%s; the SuperNode keeps retrying (see %s)",
                diagnosis.message,
                self.log_file,
            )

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
        auth_key_file = None
        if spec.auth_key is not None:
            auth_key_file = self.workdir / AUTH_KEY_FILE
            write_private(auth_key_file, openssh_private_key(spec.auth_key.read_bytes()))
        entities_file = None
        if spec.trusted_entities is not None:
            entities_file = self.workdir / TRUSTED_ENTITIES_FILE
            tmp = entities_file.with_suffix(".tmp")
            tmp.write_text(spec.trusted_entities, encoding="utf-8")
            tmp.replace(entities_file)
        command = supernode_command(
            spec, self.bin_dir, free_port(), config_file, auth_key_file, entities_file
        )
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
        # The re-encoded key is a copy of the station's: it lives no longer than its user.
        (self.workdir / AUTH_KEY_FILE).unlink(missing_ok=True)

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

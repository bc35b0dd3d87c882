"""A Mosquitto broker that fedge configures and runs itself (tests, demo, benchmarks).

Authentication is on by default: every edge has its own identity, the broker uses it as
the client id (so one edge cannot take another's session), and the ACL lets
an edge read only its ``down/`` topics and write only its ``up/`` topics. Operator
accounts (people and tools that watch the fleet) read the fleet's topics and write nothing,
so they never need the manager's identity (issue 9, defect 5: a second client under the
manager's username took over its session).

With ``tls`` (the default of a manager home, issue 13) the only listener is mutual TLS:
``require_certificate`` refuses a client without a certificate of the fleet CA,
``use_identity_as_username`` makes the certificate's common name the username the ACL is
written for (no passwords at all), and ``crlfile`` refuses revoked certificates --
re-read on SIGHUP (:meth:`MosquittoBroker.reload`). Without it (``--insecure``, for
development) the listener is plain TCP with per-user passwords.
"""

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fedge.protocols import topics
from fedge.protocols.pki import TlsFiles
from fedge.transport.errors import BrokerError
from fedge.transport.ports import free_port


@dataclass(frozen=True)
class FleetAccess:
    """Who may connect: one manager account, one account per edge (user = edge id) and
    one per operator (read-only)."""

    fleet: str
    manager_user: str
    manager_password: str
    edge_passwords: Mapping[str, str]
    operator_passwords: Mapping[str, str] = field(default_factory=dict)
    # Under TLS identities come from certificates: edges and operators are named here and
    # the password maps stay empty.
    edges: frozenset[str] = frozenset()
    operators: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # The username is the client id and the key of the password file: a name used twice
        # would let one account overwrite (or take over the session of) the other.
        edges, operators = self.edge_names, self.operator_names
        clashes = (edges & operators) | ({self.manager_user} & (edges | operators))
        if clashes:
            raise BrokerError(
                f"broker user name(s) {', '.join(sorted(clashes))} are used twice "
                "(manager, edges and operators need distinct names)"
            )

    @property
    def edge_names(self) -> set[str]:
        return set(self.edge_passwords) | set(self.edges)

    @property
    def operator_names(self) -> set[str]:
        return set(self.operator_passwords) | set(self.operators)

    def acl_text(self) -> str:
        fleet_root = f"{topics.ROOT}/{self.fleet}"
        lines = [f"user {self.manager_user}", f"topic readwrite {fleet_root}/#", ""]
        for edge in sorted(self.edge_names):
            root = topics.edge_root(self.fleet, edge)
            lines += [f"user {edge}", f"topic read {root}/down/#", f"topic write {root}/up/#", ""]
        for operator in sorted(self.operator_names):
            # Read-only: edges act only on down/ documents, which come from the manager
            # (signed), and the manager trusts up/ topics to name their writer.
            lines += [f"user {operator}", f"topic read {fleet_root}/#", ""]
        return "\n".join(lines)


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if found is None:
        raise BrokerError(
            "mosquitto is not installed; run `make setup` (apt-get install mosquitto)"
        )
    return found


class MosquittoBroker:
    """Run ``mosquitto`` on 127.0.0.1 with a generated config; stop and start it at will."""

    def __init__(
        self,
        workdir: Path,
        access: FleetAccess,
        port: int | None = None,
        *,
        tls: TlsFiles | None = None,
        host: str = "127.0.0.1",
        persistence: Path | None = None,
    ) -> None:
        self.workdir = workdir
        # Where mosquitto.db (sessions, queued messages, retained documents) is saved; a
        # save that fails (a full disk) is logged to ``log_path`` and tried again.
        self.persistence = persistence or workdir / "data"
        self.access = access
        self.tls = tls
        self.port = port or free_port()
        self.host = host
        self._process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "mosquitto.log"
        self.pid_path = workdir / "mosquitto.pid"

    def _write_passwords(self) -> Path:
        passwd = self.workdir / "passwd"
        entries = {self.access.manager_user: self.access.manager_password}
        entries.update(self.access.edge_passwords)
        entries.update(self.access.operator_passwords)
        fd = os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.writelines(f"{user}:{password}\n" for user, password in entries.items())
        hasher = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
        result = subprocess.run([hasher, "-U", str(passwd)], capture_output=True, check=False)
        if result.returncode != 0:
            raise BrokerError(f"mosquitto_passwd failed: {result.stderr.decode().strip()}")
        return passwd

    def _auth_lines(self) -> list[str]:
        if self.tls is None:
            return [f"password_file {self._write_passwords()}"]
        (self.workdir / "passwd").unlink(missing_ok=True)  # no passwords under TLS
        lines = [
            f"cafile {self.tls.ca}",
            f"certfile {self.tls.cert}",
            f"keyfile {self.tls.key}",
            "tls_version tlsv1.2",
            "require_certificate true",
            "use_identity_as_username true",
        ]
        if self.tls.crl is not None:
            lines.append(f"crlfile {self.tls.crl}")
        return lines

    def _write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        auth = self._auth_lines()
        acl = self.workdir / "acl"
        acl.write_text(self.access.acl_text())
        os.chmod(acl, 0o600)
        persistence = self.persistence
        persistence.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(
            "\n".join(
                [
                    f"listener {self.port} {self.host}",
                    # Running as root, mosquitto would drop to user "mosquitto" and lose access
                    # to our 0600 files; stay the user who started it.
                    f"user {getpass.getuser()}",
                    "allow_anonymous false",
                    *auth,
                    f"acl_file {acl}",
                    "use_username_as_clientid true",
                    "persistence true",
                    f"persistence_location {persistence}/",
                    "autosave_interval 1",
                    # The defaults (1000 queued, 20 in flight) silently drop messages for an
                    # offline persistent session; a fleet needs deep queues.
                    "max_queued_messages 1000000",
                    "max_inflight_messages 200",
                    "max_connections -1",
                    f"pid_file {self.pid_path}",
                    f"log_dest file {self.log_path}",
                    "log_type error",
                    "log_type warning",
                    "log_type notice",
                    "",
                ]
            )
        )
        return conf

    def start(self, timeout_s: float = 10.0) -> None:
        conf = self._write_config()
        with open(self.workdir / "mosquitto.stderr", "ab") as stderr:
            self._process = subprocess.Popen(
                [mosquitto_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=stderr
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = (self.workdir / "mosquitto.stderr").read_text(errors="replace")
                raise BrokerError(f"mosquitto exited at start: {err.strip()} (see {self.log_path})")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise BrokerError(f"mosquitto did not listen on {self.port} within {timeout_s}s")

    def stop(self, *, kill: bool = False) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def reload(self) -> None:
        """Re-read the password file and ACL (after adding edges)."""
        self._write_config()
        if self._process is not None:
            self._process.send_signal(signal.SIGHUP)

    def reload_running(self) -> None:
        """Rewrite passwords and ACL and signal a broker started by another process."""
        self._write_config()
        try:
            pid = int(self.pid_path.read_text().strip())
            os.kill(pid, signal.SIGHUP)
        except (OSError, ValueError):
            pass  # not running: it reads the new files when it starts

    def wait(self) -> int:
        """Block until the broker exits (foreground ``fedge manager broker``)."""
        if self._process is None:
            return 0
        return self._process.wait()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

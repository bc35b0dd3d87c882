"""A throw-away control plane for benchmarks: manager home, enrolled edges, broker, service.

Everything is real -- a Mosquitto started on a free port with the fleet's ACLs, the
manager's SQLite store, and :class:`ManagerService` in this process -- and all of it lives
in one temporary directory that :meth:`Testbed.close` removes.

Two transports, so a benchmark can run both side by side: plain TCP with a password per
edge (an ``--insecure`` home), or mutual TLS (issue 13) -- the home's fleet CA, a broker
listener that requires a client certificate and takes its name as the user, and a
certificate per simulated edge. The benchmark simulates the stations, so it makes their
keys here (a real station makes its own and sends a CSR); they are written 0600 under the
testbed's directory and only their paths go to the helper processes.
"""

import contextlib
import json
import os
import secrets
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from fedge.bench import Progress, no_progress
from fedge.bench.edge_login import EdgeLogin
from fedge.bench.errors import BenchError as BenchError  # re-exported: benches import it here
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.registry.versions import Registry
from fedge.edge_manager.security import credentials, enrollment
from fedge.edge_manager.serve import ManagerService
from fedge.edge_manager.store import Store
from fedge.protocols import pki
from fedge.protocols.pki import Role, TlsFiles
from fedge.transport.broker import MosquittoBroker
from fedge.transport.ports import free_port

FLEET = "bench"


def wait_until(
    condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.01
) -> None:
    """Poll ``condition`` until it holds; raise :class:`BenchError` naming ``what`` if not."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def flwr_run(app: Path, superlink: str, cli_home: Path, what: str) -> None:
    """``flwr run`` of the app directory ``app`` on the plain SuperLink at ``superlink``
    (a Flower CLI home of its own in ``cli_home``); BenchError naming ``what`` if refused."""
    cli_home.mkdir(parents=True, exist_ok=True)
    (cli_home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "{superlink}"\n'
        "insecure = true\n"
    )
    env = {**os.environ, "FLWR_HOME": str(cli_home), "FLWR_TELEMETRY_ENABLED": "0"}
    flwr = str(Path(sys.executable).parent / "flwr")
    result = subprocess.run(
        [flwr, "run", str(app), "bench", "--format", "json"],
        capture_output=True, text=True, env=env, timeout=180, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise BenchError(f"flwr run ({what}) failed: {result.stdout[-500:]} {result.stderr[-500:]}")


def edge_name(index: int) -> str:
    return f"e{index:05d}"


class Testbed:
    """Temp manager home with ``n_edges`` enrolled; call :meth:`start` for broker + service.

    ``tls``: mutual TLS with the fleet CA instead of passwords on plain TCP.
    """

    def __init__(
        self, n_edges: int, *, tls: bool = False, progress: Progress = no_progress
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="fedge-bench-")
        self.root = Path(self._tmp.name)
        self.progress = progress
        self.tls = tls
        self.home = ManagerHome(self.root / "home")
        # ``init`` makes the fleet CA, the broker's and the manager's certificates unless
        # the home is insecure; ManagerService then connects with its own certificate.
        self.home.init(
            ManagerSettings(
                fleet=FLEET,
                broker_port=free_port(),
                grpc_port=free_port(),
                enroll_port=free_port(),
                metrics_port=free_port(),
                insecure=not tls,
            )
        )
        self.settings = self.home.settings()
        self.store = Store(self.home.db_path)
        key = self.home.signing_key()
        self.fleet = Fleet(
            self.store,
            FLEET,
            key,
            Registry(self.store, self.home.artifacts, key),
            self.settings.grpc_target,
        )
        self.public_key = self.home.public_key_path.read_text().strip()
        self.passwords: dict[str, str] = {}  # plain runs only
        self.logins: dict[str, EdgeLogin] = {}
        if tls:
            progress(f"enrolling {n_edges} edges with certificates")
            self._enroll_with_certificates([edge_name(i) for i in range(n_edges)])
        else:
            progress(f"enrolling {n_edges} edges")
            with self.store.transaction():
                for i in range(n_edges):
                    edge = edge_name(i)
                    password = self.home.add_edge_password(edge)
                    self.fleet.enroll(edge, password)
                    self.passwords[edge] = password
                    self.logins[edge] = EdgeLogin(edge, password=password)
        self.edges = sorted(self.logins)
        self.broker: MosquittoBroker | None = None
        self.service: ManagerService | None = None
        self._reader: sqlite3.Connection | None = None

    def _enroll_with_certificates(self, edges: list[str]) -> None:
        """A client certificate per edge from the home's CA, recorded in the store (so
        :func:`enrollment.fleet_access` lets it on the broker), plus its edges row."""
        fleet_pki = self.home.pki()
        ca = fleet_pki.ca()
        folder = self.root / "edge-certs"
        folder.mkdir(mode=0o700)
        issued: list[pki.CertInfo] = []
        for edge in edges:
            cert, key = ca.issue_client(edge, Role.EDGE)
            files = TlsFiles(
                ca=fleet_pki.ca_path, cert=folder / f"{edge}.crt", key=folder / f"{edge}.key"
            )
            pki.write_private(files.key, key)
            pki.write_private(files.cert, cert)
            issued.append(pki.cert_info(pki.load_certificate(cert)))
            self.logins[edge] = EdgeLogin(edge, tls=files)
        for info in issued:  # each its own transaction (they do not nest)
            credentials.record_certificate(self.store, info)
        with self.store.transaction():
            for edge in edges:
                # The edges row; its gRPC token is a random one nobody holds, as in
                # enrollment.redeem: under TLS the certificate is the credential.
                self.fleet.enroll(edge, secrets.token_urlsafe(18))

    def start_broker(self) -> None:
        self.progress("starting mosquitto")
        # The home's broker: TLS-only with require_certificate and the CRL under TLS,
        # passwords on plain TCP otherwise.
        self.broker = enrollment.managed_broker(self.home)
        self.broker.start()

    def broker_auth(self) -> dict[str, bool]:
        """How the running broker authenticates, read back from the config it was started
        with (results carry it, so a TLS figure shows it really was mutual TLS)."""
        if self.broker is None:
            raise BenchError("the broker is not started")
        conf = (self.broker.workdir / "mosquitto.conf").read_text().splitlines()
        return {
            "require_certificate": "require_certificate true" in conf,
            "use_identity_as_username": "use_identity_as_username true" in conf,
            "password_file": any(line.startswith("password_file ") for line in conf),
        }

    def start_service(self) -> ManagerService:
        self.progress("starting the manager service")
        self.service = ManagerService(self.home)
        self.service.start()
        if not self.service.mqtt.connected.wait(10):
            raise BenchError("the manager did not connect to the broker within 10 s")
        return self.service

    def reader(self) -> sqlite3.Connection:
        """A read-only connection to the manager's store, for polling progress."""
        if self._reader is None:
            uri = f"file:{self.home.db_path}?mode=ro"
            self._reader = sqlite3.connect(uri, uri=True, check_same_thread=False)
        return self._reader

    def scalar(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        row = self.reader().execute(sql, params).fetchone()
        return None if row is None else row[0]

    def close(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.store.close()
        self._tmp.cleanup()

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class HelperProcess:
    """A ``python -m MODULE`` child that reads one JSON spec line and writes JSON events.

    A reader thread turns its stdout lines into events; the spec (which holds edge
    passwords) travels on stdin, so no secret shows on a command line.
    """

    def __init__(self, module: str, spec_line: str, log_path: Path) -> None:
        self.module = module
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"{module}-reader", daemon=True)
        self._reader.start()
        self.send(spec_line)

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(line.encode() + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"{self.module} exited early: {self.stderr_tail()}") from None

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def find(self, kind: str, **match: Any) -> dict[str, Any] | None:
        with self._cond:
            for event in self.events:
                if event.get("event") == kind and all(event.get(k) == v for k, v in match.items()):
                    return event
        return None

    def wait_event(self, kind: str, timeout_s: float, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for event in self.events:
                    if event.get("event") == kind and all(
                        event.get(k) == v for k, v in match.items()
                    ):
                        return event
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise BenchError(
                        f"{self.module} exited ({self.process.returncode}) before "
                        f"'{kind}': {self.stderr_tail()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BenchError(
                        f"{self.module}: no '{kind}' event within {timeout_s:.0f}s "
                        f"({self.stderr_tail()})"
                    )
                self._cond.wait(min(remaining, 0.5))

    def errors(self) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self.events if e.get("event") == "error"]

    def stderr_tail(self, limit: int = 800) -> str:
        self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace").strip()
        except OSError:
            return ""
        return text[-limit:] or "no stderr"

    def stop(self, timeout_s: float = 20.0) -> None:
        """Ask it to stop (a ``stop`` command), then make sure it is gone."""
        if self.process.poll() is None:
            with contextlib.suppress(BenchError):
                self.send('{"cmd": "stop"}')
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=5)
        if self.process.stdin is not None:
            self.process.stdin.close()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()

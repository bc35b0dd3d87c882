"""The fleet's Flower SuperLink as a managed process (``fedge manager superlink``).

Flower 1.41 serves the SuperLink's Fleet API (stations' SuperNodes connect to it) and
Control API (``flwr run`` submits jobs to it) over HTTP on one ``--host``/``--port``;
it starts each job's ServerApp through ``flower-superexec`` (found on PATH). Its state
lives in a SQLite file in its work directory, so a restarted SuperLink keeps its runs.

**On the wire** (issue 13) the SuperLink serves HTTPS with a server certificate from the
fleet CA (``--ssl-certfile/--ssl-keyfile/--ssl-ca-certfile``; its own SuperExec and the
ServerApps it starts trust that CA) and authenticates SuperNodes
(``--enable-supernode-auth``): every Fleet request is signed with the station's EC key
and only keys registered through the Control API (``flwr supernode register``) may
activate a node. The key is the station's own TLS key (P-256), so the public key to
register is the one in the station's certificate. Unregistering a key (revocation) makes
the SuperLink answer that node's next request with 401, on which the SuperNode exits; a
key once unregistered can never be registered again on the same database.

**Who reaches it** (issue 24). Flower 1.41 serves the Control API on the same port as
the Fleet API with no authentication of its own (open-source edition): anyone reaching it
could submit runs -- code every station would run -- and (un)register SuperNode keys. So
the ``flower-superlink`` process listens on loopback only, on a port chosen at start and
written to ``control-port`` in its work directory (:func:`control_address`), where the
manager's own tools reach it; stations reach a front on ``host:port``
(:mod:`fedge.aggregator.superlink.front`) that passes on only Fleet API calls and adds
the fleet's signature to the apps it hands out, which stations verify before running any
of an app (:mod:`fedge.protocols.app_signing`). ``tls=None``: plain HTTP, development
only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedge.aggregator.jobs.directory import JobError
from fedge.aggregator.superlink.address import (
    certificate_names_host,
    connection_toml,
    local_host,
    port_open,
)
from fedge.aggregator.superlink.front import FrontError, SuperLinkFront
from fedge.aggregator.superlink.signed_apps import SignedApps
from fedge.protocols.pki import TlsFiles
from fedge.transport.ports import free_port

SUPERLINK = "flower-superlink"
FLWR = "flwr"
CLI_CONNECTION = "fedge-superlink"
NODES_FILE = "supernodes.json"
CONTROL_PORT_FILE = "control-port"
CONTROL_HOST = "127.0.0.1"  # the SuperLink process itself: reachable from this host only
_NIST_CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what Flower's node auth accepts


class SuperLinkError(JobError):
    """The SuperLink could not be started or stopped, or a SuperNode key not (un)registered."""


def _openssh(public: object) -> str:
    if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name not in _NIST_CURVES:
        raise SuperLinkError("SuperNode keys must be ECDSA on a NIST curve (fleet keys: P-256)")
    raw = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return raw.decode()


def node_public_key(pem: bytes) -> str:
    """The OpenSSH public key line ``flwr supernode register`` takes, from a station's
    certificate (or public key) in PEM."""
    try:
        if b"CERTIFICATE" in pem:
            return _openssh(x509.load_pem_x509_certificate(pem).public_key())
        return _openssh(serialization.load_pem_public_key(pem))
    except ValueError as exc:
        raise SuperLinkError(f"not a PEM certificate or public key: {exc}") from None


def _checked_ssh_key(public_key: str) -> str:
    try:
        key = serialization.load_ssh_public_key(public_key.strip().encode())
    except (ValueError, UnicodeError) as exc:
        raise SuperLinkError(f"not an OpenSSH public key line: {exc}") from None
    return _openssh(key)


@dataclass(frozen=True)
class AuthorizedNode:
    """A SuperNode key registered with the SuperLink, under the station it belongs to."""

    name: str
    node_id: int
    public_key: str  # OpenSSH line


def plan_sync(
    current: Mapping[str, AuthorizedNode], wanted: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """(names to register, names to unregister) so that exactly ``wanted`` (name -> key)
    is authorised; a station whose key changed is unregistered, then registered again."""
    remove = sorted(n for n, node in current.items() if wanted.get(n) != node.public_key)
    add = sorted(n for n, key in wanted.items() if n not in current or n in remove)
    return add, remove


class SuperLink:
    """One ``flower-superlink`` process on loopback, its database and log in ``workdir``,
    behind a front on ``host:port`` that passes on only the Fleet API; with ``tls``, HTTPS
    and (``node_auth``) only registered SuperNode keys admitted."""

    def __init__(
        self,
        workdir: Path,
        host: str,
        port: int,
        *,
        tls: TlsFiles | None = None,
        node_auth: bool = True,
    ) -> None:
        self.workdir = workdir
        self.host = host
        self.port = port
        self.tls = tls
        # Flower refuses SuperNode authentication without TLS; plain is development only.
        self.node_auth = node_auth and tls is not None
        self.bin_dir = Path(sys.executable).parent
        self.control_port = 0  # chosen at start
        self._proc: subprocess.Popen[bytes] | None = None
        self._front: SuperLinkFront | None = None

    @property
    def address(self) -> str:
        """Where stations connect (the front)."""
        return f"{self.host}:{self.port}"

    @property
    def local_address(self) -> str:
        """Where this host's tools reach the SuperLink itself (Control API included): the
        port this object started it on, or the one its owner wrote down."""
        if self.control_port:
            return f"{CONTROL_HOST}:{self.control_port}"
        return control_address(self.workdir)

    @property
    def log_path(self) -> Path:
        return self.workdir / "superlink.log"

    @property
    def signed_apps(self) -> SignedApps:
        return SignedApps.of(self.workdir)

    @property
    def front(self) -> SuperLinkFront | None:
        return self._front

    @property
    def running(self) -> bool:
        return (
            self._proc is not None
            and self._proc.poll() is None
            and self._front is not None
            and self._front.running
        )

    def command(self) -> list[str]:
        if self.tls is None:
            security = ["--insecure"]
        else:
            security = [
                "--ssl-ca-certfile", str(self.tls.ca),
                "--ssl-certfile", str(self.tls.cert),
                "--ssl-keyfile", str(self.tls.key),
            ]  # fmt: skip
            if self.node_auth:
                security.append("--enable-supernode-auth")
        return [
            str(self.bin_dir / SUPERLINK),
            *security,
            "--disable-runtime-dependency-installation",
            "--database",
            str(self.workdir / "superlink.db"),
            "--host",
            CONTROL_HOST,
            "--port",
            str(self.control_port),
        ]

    def _check_tls(self) -> None:
        if self.tls is None:
            return
        for what, path in (
            ("CA", self.tls.ca),
            ("certificate", self.tls.cert),
            ("key", self.tls.key),
        ):
            if not path.is_file():
                raise SuperLinkError(
                    f"the SuperLink's TLS {what} {path} is missing; `fedge manager init` "
                    "makes it (or run the SuperLink --insecure for development)"
                )
        try:
            names_host = certificate_names_host(self.tls.cert.read_bytes(), CONTROL_HOST)
        except ValueError as exc:
            raise SuperLinkError(f"{self.tls.cert} is not a PEM certificate: {exc}") from None
        if not names_host:
            # Flower's SuperExec and ServerApps, and the front, connect on loopback: a
            # certificate that does not name it would start a SuperLink whose jobs never run.
            raise SuperLinkError(
                f"{self.tls.cert} does not name {CONTROL_HOST}; reissue the "
                "server certificates for this host (`fedge manager advertise`)"
            )

    def start(self, timeout_s: float = 60.0) -> None:
        if not (self.bin_dir / SUPERLINK).exists():
            raise SuperLinkError(
                f"{SUPERLINK} is not installed in {self.bin_dir} (pip install 'fedge[train]')"
            )
        self._check_tls()
        if port_open(local_host(self.host), self.port):
            raise SuperLinkError(f"{self.address} is already in use (another SuperLink?)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.control_port = free_port()
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
        while not port_open(CONTROL_HOST, self.control_port):
            if self._proc.poll() is not None:
                raise SuperLinkError(f"{SUPERLINK} exited at start; see {self.log_path}")
            if time.monotonic() >= end:
                self.stop()
                raise SuperLinkError(f"{SUPERLINK} did not listen within {timeout_s:.0f}s")
            time.sleep(0.1)
        try:
            self._front = SuperLinkFront(
                self.host,
                self.port,
                self.control_port,
                self.signed_apps,
                tls=self.tls,
                node_auth=self.node_auth,
                registered=self.registered_keys if self.node_auth else None,
            )
        except FrontError as exc:
            self.stop()
            raise SuperLinkError(str(exc)) from None
        try:
            self._front.start()
        except FrontError as exc:
            self.stop()
            raise SuperLinkError(str(exc)) from None
        tmp = self.workdir / (CONTROL_PORT_FILE + ".tmp")
        tmp.write_text(f"{self.control_port}\n", encoding="utf-8")
        tmp.replace(self.workdir / CONTROL_PORT_FILE)

    def stop(self) -> None:
        (self.workdir / CONTROL_PORT_FILE).unlink(missing_ok=True)
        front, self._front = self._front, None
        if front is not None:
            front.stop()
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

    # ------------------------------------------------------------ authorised SuperNodes
    # Flower's own CLI talks to the Control API (the SuperLink must be running, in this
    # process or another); which key belongs to which station is kept in NODES_FILE, as
    # Flower lists node ids but not their keys.

    def authorized(self) -> dict[str, AuthorizedNode]:
        try:
            raw = json.loads((self.workdir / NODES_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        return {
            name: AuthorizedNode(name, int(v["node_id"]), v["public_key"])
            for name, v in raw.items()
        }

    def registered_keys(self) -> dict[bytes, int]:
        """Each registered key as Flower's SuperNode sends it (PEM SubjectPublicKeyInfo)
        -> its node id: how the front tells a still-active node from an unknown key."""
        keys = {}
        for node in self.authorized().values():
            public = serialization.load_ssh_public_key(node.public_key.encode())
            pem = public.public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            keys[pem] = node.node_id
        return keys

    def authorize(self, name: str, public_key: str) -> AuthorizedNode:
        """Admit the SuperNode of station ``name`` holding ``public_key`` (OpenSSH line,
        see :func:`node_public_key`); a new key for the station replaces its old one."""
        public_key = _checked_ssh_key(public_key)
        with self._nodes_locked():
            current = self.authorized()
            node = current.get(name)
            if node is not None and node.public_key == public_key:
                return node
            if node is not None:  # a renewed key: the old one goes first, and for good
                self._unregister(node)
                del current[name]
                self._save(current)
            added = self._register(name, public_key)
            self._save({**current, name: added})
            return added

    def revoke(self, name: str) -> AuthorizedNode | None:
        """Refuse station ``name``'s SuperNode from its next request on (its key can never
        be registered again here); None if it was not authorised."""
        with self._nodes_locked():
            current = self.authorized()
            node = current.pop(name, None)
            if node is not None:
                self._unregister(node)
                self._save(current)
            return node

    def sync(self, wanted: Mapping[str, str]) -> tuple[list[str], list[str]]:
        """Authorise exactly ``wanted`` (station -> OpenSSH key); returns (added, removed)."""
        add, remove = plan_sync(self.authorized(), wanted)
        for name in remove:
            self.revoke(name)
        for name in add:
            self.authorize(name, wanted[name])
        return add, remove

    def nodes(self) -> list[dict[str, Any]]:
        """The SuperLink's nodes as ``flwr supernode ls`` lists them (id, status, ...)."""
        nodes: list[dict[str, Any]] = self._flwr("ls").get("nodes", [])
        return nodes

    def _register(self, name: str, public_key: str) -> AuthorizedNode:
        if not self.node_auth:
            raise SuperLinkError("SuperNode authentication is off on this SuperLink (it needs TLS)")
        key_file = self.workdir / "flwr-cli" / "register.pub"
        key_file.parent.mkdir(parents=True, exist_ok=True)
        key_file.write_text(public_key + "\n", encoding="utf-8")
        try:
            answer = self._flwr("register", str(key_file), name=name)
        finally:
            key_file.unlink(missing_ok=True)
        return AuthorizedNode(name, int(answer["node-id"]), public_key)

    def _unregister(self, node: AuthorizedNode) -> None:
        try:
            self._flwr("unregister", str(node.node_id))
        except SuperLinkError as exc:
            if "not found" not in str(exc).lower():  # already gone: what we wanted
                raise

    def _flwr(self, command: str, *args: str, name: str = "") -> dict[str, Any]:
        """``flwr supernode COMMAND ARGS`` against this SuperLink; Flower's JSON answer."""
        flwr = self.bin_dir / FLWR
        if not flwr.exists():
            raise SuperLinkError(f"the `flwr` command is not installed in {self.bin_dir}")
        cli_home = self.workdir / "flwr-cli"
        cli_home.mkdir(parents=True, exist_ok=True)
        ca = None if self.tls is None else self.tls.ca
        (cli_home / "config.toml").write_text(
            connection_toml(CLI_CONNECTION, self.local_address, ca), encoding="utf-8"
        )
        extra = ["--name", name] if name else []
        argv = [str(flwr), "supernode", command, *args, CLI_CONNECTION, *extra, "--format", "json"]
        env = {**os.environ, "FLWR_HOME": str(cli_home), "FLWR_TELEMETRY_ENABLED": "0"}
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, env=env, timeout=60, check=False
            )
        except subprocess.TimeoutExpired:
            raise SuperLinkError(
                f"`flwr supernode {command}` got no answer within 60 s from {self.local_address}"
            ) from None
        text = done.stdout
        answer: dict[str, Any] = {}
        if "{" in text:
            with contextlib.suppress(json.JSONDecodeError):
                answer = json.loads(text[text.index("{") :])
        if not answer.get("success"):
            detail = str(answer.get("error-message") or done.stderr or text).strip()
            detail = detail.split("\n\n", 1)[-1][-500:]  # drop Flower's "Using SuperLink" line
            raise SuperLinkError(
                f"`flwr supernode {command}` failed against the SuperLink at "
                f"{self.local_address}: {detail}"
            )
        return answer

    @contextlib.contextmanager
    def _nodes_locked(self) -> Iterator[None]:
        """One writer of NODES_FILE at a time (the SuperLink's owner and `edge revoke`)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / (NODES_FILE + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _save(self, nodes: Mapping[str, AuthorizedNode]) -> None:
        data = {n: {"node_id": v.node_id, "public_key": v.public_key} for n, v in nodes.items()}
        tmp = self.workdir / (NODES_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
        tmp.replace(self.workdir / NODES_FILE)


def control_address(workdir: Path) -> str:
    """Where this host reaches the running SuperLink of ``workdir`` itself (``flwr run``,
    ``flwr supernode``): loopback, on the port its owner chose at start."""
    try:
        port = int((workdir / CONTROL_PORT_FILE).read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        raise SuperLinkError(
            f"no SuperLink is running from {workdir} (no {CONTROL_PORT_FILE} file): start it "
            "with `fedge manager superlink`, on this host"
        ) from None
    return f"{CONTROL_HOST}:{port}"

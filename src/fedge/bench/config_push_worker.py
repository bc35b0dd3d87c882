"""One process of simulated edges for the config-push benchmark.

Run as ``python -m fedge.bench.config_push_worker``; the parent writes one JSON spec line
on stdin (broker address, fleet, the manager's pinned public key, and this worker's
edge logins -- a password each, or under mutual TLS the paths of each edge's
certificate files -- on a pipe, never on the command line) and reads JSON event lines on
stdout.

Each edge is a real MQTT v5 session authenticated as itself (by password, or by its
client certificate: the broker takes the certificate's name as the user) that follows
the agent's config path minus ONNX: verify the signed :class:`EdgeConfig` with the pinned
key, decide with :func:`decide_config`, persist the applied document (one local SQLite
commit, as the agent does before reporting), and publish a retained QoS 1
:class:`ConfigReport`.

All clients are driven from ONE thread with paho's external-loop API over an epoll
selector: paho's own loop uses ``select()`` (which breaks past 1024 descriptors) and one
thread per client would spend the benchmark's CPU on thread switches. Under TLS, OpenSSL
may already hold decrypted bytes the socket no longer signals (``SSLSocket.pending()``),
so those clients are read again without waiting on the selector.

Events written: ``ready`` (all connected and subscribed; how many over TLS),
``applied`` (every edge of this worker applied ``version``), ``error``, and on the
``stop`` command ``timings`` rows ``[edge, version, received_at, reported_at, acked_at]``
(wall-clock seconds).
"""

import contextlib
import json
import os
import selectors
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fedge import __version__
from fedge.bench.edge_login import EdgeLogin, emit
from fedge.edge_agent.config.decisions import ConfigAction, decide_config
from fedge.edge_agent.store import LocalStore
from fedge.protocols import codec, topics
from fedge.protocols.config import ConfigReport, ConfigStatus, EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.protocols.signing import PublicKey, TrustedKeys, open_signed, trusted

MISC_INTERVAL_S = 1.0  # keepalive bookkeeping (loop_misc) and reconnects
STDIN_FD = 0


@dataclass(frozen=True)
class WorkerSpec:
    host: str
    port: int
    fleet: str
    public_key: str
    edges: list[EdgeLogin]
    store_path: str
    keepalive_s: int = 60

    @classmethod
    def from_json(cls, line: str) -> "WorkerSpec":
        data = json.loads(line)
        data["edges"] = [EdgeLogin.from_json(entry) for entry in data["edges"]]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(
            {
                "host": self.host,
                "port": self.port,
                "fleet": self.fleet,
                "public_key": self.public_key,
                "edges": [login.to_json() for login in self.edges],
                "store_path": self.store_path,
                "keepalive_s": self.keepalive_s,
            }
        )


@dataclass
class SimEdge:
    edge: str
    client: paho.Client
    config: EdgeConfig | None = None
    connected: bool = False
    subscribed: bool = False
    tls_version: str | None = None  # the session's TLS protocol, None on plain TCP
    last_report: bytes | None = None
    # version -> [received_at, reported_at, acked_at]
    timings: dict[int, list[float | None]] = field(default_factory=dict)
    # mid of an in-flight report -> the version it reports
    reports_in_flight: dict[int, int] = field(default_factory=dict)


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.keys: TrustedKeys = trusted(PublicKey.from_text(spec.public_key))
        self.store = LocalStore(Path(spec.store_path))
        self.selector = selectors.DefaultSelector()
        self.edges: dict[str, SimEdge] = {}
        self.applied_count: dict[int, int] = {}
        self.ready_sent = False
        self.running = True
        self.stdin_buffer = b""
        self.errors = 0
        self.buffered: set[paho.Client] = set()  # TLS clients with bytes inside OpenSSL
        for login in spec.edges:
            self.edges[login.edge] = SimEdge(login.edge, self._client(login))

    # -- paho clients and their selector registration

    def _client(self, login: EdgeLogin) -> paho.Client:
        edge = login.edge
        client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=edge, protocol=paho.MQTTv5, userdata=edge
        )
        if login.tls is not None:
            # Mutual TLS: the certificate is the identity, so no username or password.
            client.tls_set(
                ca_certs=str(login.tls.ca),
                certfile=str(login.tls.cert),
                keyfile=str(login.tls.key),
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
            )
        else:
            client.username_pw_set(edge, login.password)
        will = Liveness(edge, 0, EdgeState.LOST, __version__)
        client.will_set(self._up(edge, topics.Up.STATE), codec.encode(will), qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_disconnect = self._on_disconnect
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = self._on_unregister_write
        return client

    def _on_socket_open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        self.selector.register(sock, selectors.EVENT_READ, client)

    def _on_socket_close(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)

    def _on_register_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)

    def _on_unregister_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.modify(sock, selectors.EVENT_READ, client)

    def _up(self, edge: str, kind: topics.Up) -> str:
        return topics.up(self.spec.fleet, edge, kind)

    def connect_all(self) -> None:
        for sim in self.edges.values():
            self._connect(sim)

    def _connect(self, sim: SimEdge) -> None:
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 3600
        try:
            sim.client.connect(
                self.spec.host,
                self.spec.port,
                keepalive=self.spec.keepalive_s,
                clean_start=True,
                properties=props,
            )
        except OSError as exc:
            self.errors += 1
            emit({"event": "error", "edge": sim.edge, "detail": f"connect: {exc}"})

    # -- MQTT callbacks (all on this one thread)

    def _on_connect(
        self,
        client: paho.Client,
        edge: str,
        flags: paho.ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        sim = self.edges[edge]
        if reason_code.is_failure:
            self.errors += 1
            emit({"event": "error", "edge": edge, "detail": f"refused: {reason_code}"})
            return
        sim.connected = True
        sock = client.socket()
        sim.tls_version = sock.version() if isinstance(sock, ssl.SSLSocket) else None
        # The agent's order: subscribe, birth, then re-state the config in force.
        client.subscribe(topics.edge_subscription(self.spec.fleet, edge), qos=1)
        applied = 0 if sim.config is None else sim.config.version
        birth = Liveness(edge, 0, EdgeState.ONLINE, __version__, "", applied, time.time())
        client.publish(self._up(edge, topics.Up.STATE), codec.encode(birth), qos=1, retain=True)
        if sim.last_report is not None:
            client.publish(self._up(edge, topics.Up.CONFIG), sim.last_report, qos=1, retain=True)

    def _on_subscribe(
        self,
        client: paho.Client,
        edge: str,
        mid: int,
        reason_codes: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        if any(code.is_failure for code in reason_codes):
            self.errors += 1
            emit({"event": "error", "edge": edge, "detail": f"subscribe refused: {reason_codes}"})
            return
        self.edges[edge].subscribed = True

    def _on_disconnect(
        self,
        client: paho.Client,
        edge: str,
        flags: paho.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        sim = self.edges[edge]
        sim.connected = sim.subscribed = False
        if self.running:
            self.errors += 1
            emit({"event": "error", "edge": edge, "detail": f"disconnected: {reason_code}"})

    def _on_message(self, client: paho.Client, edge: str, msg: paho.MQTTMessage) -> None:
        received = time.time()
        sim = self.edges[edge]
        try:
            offered = open_signed(bytes(msg.payload), EdgeConfig, self.keys)
        except ProtocolError as exc:
            self._report(sim, ConfigStatus.REJECTED, 0, f"{exc.reason}: {exc}", None)
            return
        decision = decide_config(sim.config, offered, self.spec.fleet, edge)
        if decision.action is ConfigAction.APPLY:
            # Persist first, as the agent does: after a crash it comes back with what it reported.
            self.store.put(f"applied_config.{edge}", codec.encode(offered).decode())
            sim.config = offered
            sim.timings[offered.version] = [received, None, None]
            self._report(sim, ConfigStatus.APPLIED, offered.version, "", offered.version)
            count = self.applied_count.get(offered.version, 0) + 1
            self.applied_count[offered.version] = count
            if count == len(self.edges):
                emit({"event": "applied", "version": offered.version, "at": time.time()})
        elif decision.action is ConfigAction.IGNORE:
            if sim.last_report is None:
                self._report(sim, ConfigStatus.APPLIED, offered.version, "", None)
        else:
            self._report(sim, ConfigStatus.REJECTED, offered.version, decision.reason, None)

    def _report(
        self, sim: SimEdge, status: ConfigStatus, offered: int, reason: str, timed: int | None
    ) -> None:
        applied = 0 if sim.config is None else sim.config.version
        now = time.time()
        payload = codec.encode(ConfigReport(sim.edge, status, applied, offered, reason[:1000], now))
        sim.last_report = payload
        info = sim.client.publish(self._up(sim.edge, topics.Up.CONFIG), payload, qos=1, retain=True)
        if timed is not None:
            sim.timings[timed][1] = now
            sim.reports_in_flight[info.mid] = timed

    def _on_publish(
        self,
        client: paho.Client,
        edge: str,
        mid: int,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        sim = self.edges[edge]
        version = sim.reports_in_flight.pop(mid, None)
        if version is not None and version in sim.timings:
            sim.timings[version][2] = time.time()

    # -- the loop

    def _check_ready(self) -> None:
        if not self.ready_sent and all(s.connected and s.subscribed for s in self.edges.values()):
            self.ready_sent = True
            # Evidence of the transport: how many sessions run TLS.
            on_tls = sum(s.tls_version is not None for s in self.edges.values())
            emit({"event": "ready", "edges": len(self.edges), "tls_sessions": on_tls})

    def _read_commands(self) -> None:
        try:
            chunk = os.read(STDIN_FD, 65536)
        except BlockingIOError:
            return
        if not chunk:  # the parent went away: stop rather than linger
            self.running = False
            return
        self.stdin_buffer += chunk
        while b"\n" in self.stdin_buffer:
            line, self.stdin_buffer = self.stdin_buffer.split(b"\n", 1)
            if line.strip() and json.loads(line).get("cmd") == "stop":
                self.running = False

    def _read(self, client: paho.Client) -> None:
        client.loop_read()
        # paho reads a bounded number of packets; under TLS the rest may already be
        # decrypted inside OpenSSL, where the selector cannot see it: read it next turn.
        sock = client.socket()
        if isinstance(sock, ssl.SSLSocket) and sock.pending() > 0:
            self.buffered.add(client)

    def run(self) -> None:
        stdin_fd = STDIN_FD
        os.set_blocking(stdin_fd, False)
        self.selector.register(stdin_fd, selectors.EVENT_READ, None)
        self.connect_all()
        last_misc = time.monotonic()
        while self.running:
            buffered, self.buffered = self.buffered, set()
            for client in buffered:
                self._read(client)
            timeout = 0.0 if self.buffered else MISC_INTERVAL_S
            for key, mask in self.selector.select(timeout=timeout):
                client = key.data
                if client is None:
                    self._read_commands()
                    continue
                if mask & selectors.EVENT_READ:
                    self._read(client)
                if mask & selectors.EVENT_WRITE:
                    client.loop_write()
            self._check_ready()
            if time.monotonic() - last_misc >= MISC_INTERVAL_S:
                last_misc = time.monotonic()
                for sim in self.edges.values():
                    if sim.client.socket() is None:
                        self._connect(sim)  # lost: come back, as the agent would
                    else:
                        sim.client.loop_misc()
        self.shutdown()

    def shutdown(self) -> None:
        rows = [
            [sim.edge, version, *times]
            for sim in self.edges.values()
            for version, times in sorted(sim.timings.items())
        ]
        emit({"event": "timings", "rows": rows, "errors": self.errors})
        for sim in self.edges.values():
            if sim.client.socket() is not None:
                sim.client.disconnect()
                # Flush DISCONNECT now (paho closes the socket once it is written) so the
                # broker publishes no will.
                sim.client.loop_write()
        self.store.close()
        emit({"event": "stopped"})


def read_spec_line() -> tuple[str, bytes]:
    """The first stdin line, read from the descriptor itself (no buffered reader).

    Commands arrive on the same descriptor later; a buffered ``sys.stdin`` could swallow
    them where the selector never sees them. Returns the line and any bytes after it.
    """
    buffer = b""
    while b"\n" not in buffer:
        chunk = os.read(STDIN_FD, 65536)
        if not chunk:
            raise SystemExit("config_push_worker: no spec on stdin")
        buffer += chunk
    line, rest = buffer.split(b"\n", 1)
    return line.decode(), rest


def main() -> None:
    line, rest = read_spec_line()
    worker = Worker(WorkerSpec.from_json(line))
    worker.stdin_buffer = rest
    worker.run()


if __name__ == "__main__":
    main()

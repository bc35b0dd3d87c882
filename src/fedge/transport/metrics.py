"""Prometheus metrics and health probes over HTTP (issue 27).

    GET /metrics  the process's registry in Prometheus' text format
    GET /healthz  200 while the process answers at all (liveness)
    GET /readyz   200 when every readiness check passes, else 503 with the ones that fail

Each process (``manager serve``, an agent, an aggregator job) builds its own
:class:`prometheus_client.CollectorRegistry`: no library code touches prometheus_client's
global registry, so two services in one process (tests, the demo) never mix series.
Collectors read the counters and stores the process keeps anyway when scraped, rather
than adding bookkeeping to hot paths.

:class:`MetricsServer` serves the three paths for the manager and aggregator; the agent
answers them on its local API (:func:`probe_reply` is shared). Bound to loopback by
default: metrics name stations, models and certificates. Bound elsewhere it needs an
:class:`ssl.SSLContext` that requires a client certificate (the fleet's CA), so whoever
reaches the port without a fleet credential gets nothing. :class:`ServerTlsContext`
builds that context from the files and builds it again at the first handshake after they
change, so a renewed certificate (the manager's CredentialKeeper, a station's renewal)
is served without a restart.
"""

import json
import logging
import os
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socket import socket
from typing import Any

from cryptography import x509
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from fedge.protocols import pki
from fedge.protocols.pki import CertificateError, Role, TlsFiles
from fedge.transport.errors import TransportError
from fedge.transport.grpc.identity import RevocationList

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class Readiness:
    """The outcome of the readiness checks: each check's name and None (passes) or why not."""

    checks: Mapping[str, str | None]

    @property
    def ready(self) -> bool:
        return all(why is None for why in self.checks.values())

    def describe(self) -> dict[str, object]:
        return {
            "ready": self.ready,
            "checks": {name: why or "ok" for name, why in self.checks.items()},
        }


@dataclass(frozen=True)
class ProbeReply:
    status: HTTPStatus
    content_type: str
    body: bytes


def _json(status: HTTPStatus, body: object) -> ProbeReply:
    return ProbeReply(status, "application/json", json.dumps(body).encode())


def probe_reply(
    path: str, registry: CollectorRegistry, readiness: Callable[[], Readiness]
) -> ProbeReply | None:
    """The reply to ``GET path`` for the three probe paths; None for any other path."""
    route = path.split("?", 1)[0]
    if route == "/metrics":
        return ProbeReply(HTTPStatus.OK, CONTENT_TYPE_LATEST, generate_latest(registry))
    if route == "/healthz":
        return _json(HTTPStatus.OK, {"alive": True})
    if route == "/readyz":
        try:
            outcome = readiness()
        except Exception as exc:  # a check that fails to run is a failed check
            log.exception("readiness check failed to run")
            outcome = Readiness({"checks": f"{type(exc).__name__}: {exc}"})
        status = HTTPStatus.OK if outcome.ready else HTTPStatus.SERVICE_UNAVAILABLE
        return _json(status, outcome.describe())
    return None


class MetricsError(TransportError):
    """The metrics endpoint cannot be served as configured."""


# Who may read the fleet's metrics over mutual TLS: operators' tools and the manager,
# never a station (its certificate is from the same CA, and the metrics name the fleet).
METRICS_ROLES = frozenset({Role.OPERATOR, Role.MANAGER})


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    readiness: Callable[[], Readiness]
    revocations: RevocationList | None = None

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics: " + format, *args)

    def do_GET(self) -> None:
        refused = self._refusal()
        if refused is not None:
            log.warning("metrics: refused %s: %s", self.client_address[0], refused)
            self._send(_json(HTTPStatus.FORBIDDEN, {"error": refused}))
            return
        reply = probe_reply(self.path, self.registry, type(self).readiness)
        if reply is None:
            reply = _json(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path[:100]}"})
        self._send(reply)

    def _send(self, reply: Any) -> None:
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        self.wfile.write(reply.body)

    def _refusal(self) -> str | None:
        """Why this TLS peer may not read metrics (None: it may, or this is loopback
        without TLS). The role is checked here, and the CRL re-read when it changes, so a
        revocation after start counts (the TLS context was built once)."""
        connection = self.connection
        if not isinstance(connection, ssl.SSLSocket):
            return None
        der = connection.getpeercert(binary_form=True)
        if der is None:
            return "no client certificate"
        try:
            info = pki.cert_info(x509.load_der_x509_certificate(der))
            revoked = frozenset() if self.revocations is None else self.revocations.serials()
        except (ValueError, CertificateError) as exc:
            return f"the certificate cannot be checked: {exc}"
        if info.serial in revoked:
            return f"{info.identity!r} holds a revoked certificate"
        if info.role not in METRICS_ROLES:
            role = "no role" if info.role is None else info.role.value
            return (
                f"{info.identity!r} holds a certificate of role {role}; only an operator's "
                "or the manager's certificate may read the fleet's metrics"
            )
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # A stalled client costs its thread a bounded time, not for ever.
    timeout_s = 10.0

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        context: "ssl.SSLContext | ServerTlsContext | None",
    ) -> None:
        self.context = context
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket, Any]:
        conn, address = super().get_request()
        conn.settimeout(self.timeout_s)
        context = self.context
        if isinstance(context, ServerTlsContext):
            context = context.current()
        if context is not None:
            # The handshake runs in the request's thread, on its first read (not here, in
            # the accepting one): a peer that never shakes hands stalls only its thread.
            conn = context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: connection from %s failed", client_address, exc_info=True)


class MetricsServer:
    """/metrics, /healthz and /readyz on ``host:port`` (0: a free one, read from
    :attr:`port`), bound here, served from :meth:`start` until :meth:`stop`.

    Raises :class:`MetricsError` when ``host`` is not loopback and no TLS context is
    given, or when the address cannot be bound.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        readiness: Callable[[], Readiness],
        host: str,
        port: int,
        *,
        context: "ssl.SSLContext | ServerTlsContext | None" = None,
        crl: Path | None = None,
        name: str = "metrics",
    ) -> None:
        if host not in LOOPBACK and context is None:
            raise MetricsError(
                f"metrics on {host}:{port} without TLS would show the fleet to anyone on the "
                "network; bind metrics_host to 127.0.0.1, or serve it with the fleet's "
                "certificates (not an --insecure home)"
            )
        handler = type(
            "MetricsHandler",
            (_Handler,),
            {
                "registry": registry,
                "readiness": staticmethod(readiness),
                "revocations": None if crl is None else RevocationList(crl),
            },
        )
        try:
            self._server = _Server((host, port), handler, context)
        except OSError as exc:
            raise MetricsError(
                f"cannot serve metrics on {host} port {port}: {exc.strerror}; set metrics_port "
                "to a free port (0 turns metrics off)"
            ) from None
        self.host = host
        self.port = int(self._server.server_address[1])
        self.tls = context is not None
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


def mutual_tls_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context that serves ``files``' certificate and admits only clients with a
    certificate from its CA (and not on its CRL, when the files name one)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(files.cert), str(files.key))
    context.load_verify_locations(cafile=str(files.ca))
    if files.crl is not None and files.crl.exists():
        context.load_verify_locations(cafile=str(files.crl))
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _signature(files: TlsFiles) -> tuple[tuple[int, int, int], ...]:
    paths = [files.cert, files.key, files.ca]
    if files.crl is not None and files.crl.exists():
        paths.append(files.crl)
    stats = [os.stat(path) for path in paths]
    return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)


class ServerTlsContext:
    """:func:`mutual_tls_context` of ``files``, built again once the files change.

    :meth:`current` is asked at every accepted connection: one ``stat`` per file while
    nothing changed; a new context after a renewal replaced the certificate (the manager's
    ``CredentialKeeper`` or a station's renewal write new files in place), a new CA bundle
    or a new CRL. A pair caught half written (the renewal moves the key, then the
    certificate), or a file that cannot be read, keeps the context in use: the next
    connection looks again. The same rule as gRPC's server (transport/grpc/tls.py).

    Raises ``OSError`` / ``ssl.SSLError`` at construction when the files cannot serve.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._signature = _signature(files)
        self._context = mutual_tls_context(files)
        self.reloads = 0

    def current(self) -> ssl.SSLContext:
        try:
            signature = _signature(self.files)
        except OSError:
            return self._context
        with self._lock:
            if signature == self._signature:
                return self._context
        try:
            context = mutual_tls_context(self.files)
        except (OSError, ssl.SSLError) as exc:
            log.debug("TLS files changed but cannot be loaded yet (%s); kept the current", exc)
            return self._context
        with self._lock:
            self._signature, self._context = signature, context
            self.reloads += 1
        log.info("serving the renewed certificate %s", self.files.cert)
        return context

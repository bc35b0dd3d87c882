"""HTTPS served by uvicorn: the client certificate handed to the app, and a server that
a stranger cannot stall (issue 24).

:class:`ClientCertH11` is uvicorn's h11 protocol filling the ASGI TLS extension with the
client certificate the TLS layer verified (the console's certificate login and the
enrollment endpoint's renewal both read it). :class:`GuardedServer` serves an ASGI app on
a socket it binds at construction, in a thread with its own event loop, with a deadline
on every stage a peer could otherwise hold open for ever:

- the TLS handshake (asyncio's ``ssl_handshake_timeout``, which uvicorn leaves at its 60 s
  default: set here through the loop, see :class:`_HandshakeDeadlineLoop`);
- the request's headers, from the end of the handshake (:func:`_header_deadline`); the
  app bounds the body's own reading;
- an idle kept-alive connection (uvicorn's ``timeout_keep_alive``).

Connections are asyncio transports: an idle or slow one costs a socket, never a thread,
and never holds up another.
"""

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class ClientCertH11(H11Protocol):
    """uvicorn's h11 protocol, handing the client certificate the TLS layer verified to
    the app as the ASGI TLS extension (``client_cert_chain``), which uvicorn 0.49 does
    not fill in. One protocol object per connection: the certificate is that
    connection's, read after its handshake."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        der = None if ssl_object is None else ssl_object.getpeercert(binary_form=True)
        if der:
            self.app = _with_client_cert(self.app, ssl.DER_cert_to_PEM_cert(der))


def _with_client_cert(app: ASGIApp, pem: str) -> ASGIApp:
    async def with_tls(scope: Scope, receive: Receive, send: Send) -> None:
        extensions = dict(scope.get("extensions") or {})
        extensions["tls"] = {"client_cert_chain": [pem], "client_cert_error": None}
        await app({**scope, "extensions": extensions}, receive, send)

    return with_tls


def presented_chain(scope: Mapping[str, Any]) -> list[str]:
    """The verified client certificate chain (PEM, leaf first) of the connection, from
    the ASGI TLS extension (empty: none, not over TLS, or it failed verification)."""
    tls = scope.get("extensions", {}).get("tls") or {}
    if tls.get("client_cert_error") is not None:
        return []
    return [str(pem) for pem in tls.get("client_cert_chain") or []]


def _header_deadline(timeout_s: float, on_timeout: Callable[[], None]) -> type[ClientCertH11]:
    """:class:`ClientCertH11` closing a connection whose request headers have not all
    arrived ``timeout_s`` after its handshake (a slowloris trickling them, or a peer that
    shakes hands and says nothing); ``on_timeout`` is called for each one cut."""

    class HeaderDeadlineH11(ClientCertH11):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline = self.loop.call_later(timeout_s, self._too_slow)
            app = self.app

            # uvicorn calls the app once the headers are complete: the deadline is met.
            async def headers_in(scope: Scope, receive: Receive, send: Send) -> None:
                self._meet_deadline()
                await app(scope, receive, send)

            self.app = headers_in

        def connection_lost(self, exc: Exception | None) -> None:
            self._meet_deadline()
            super().connection_lost(exc)

        def _meet_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                on_timeout()
                self.transport.abort()

    return HeaderDeadlineH11


class _HandshakeDeadlineLoop(asyncio.SelectorEventLoop):
    """An event loop whose servers give up on a TLS handshake after ``timeout_s``:
    uvicorn's ``create_server`` call passes no ``ssl_handshake_timeout``, so asyncio's
    60 s default would let each silent socket sit in the handshake for a minute."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.handshake_timeout_s = timeout_s

    async def create_server(self, *args: Any, **kwargs: Any) -> asyncio.Server:
        if kwargs.get("ssl") is not None:
            kwargs.setdefault("ssl_handshake_timeout", self.handshake_timeout_s)
        return await super().create_server(*args, **kwargs)


@dataclass(frozen=True)
class Deadlines:
    """How long a peer may take, in seconds, at each stage of a connection."""

    handshake_s: float = 10.0
    headers_s: float = 10.0
    body_s: float = 10.0
    """Not enforced here: the app bounds its reading of a body with it."""
    keep_alive_s: int = 5


class GuardedServer:
    """``app`` over HTTPS (``context``; None: plain HTTP, for a development home made
    ``--insecure`` only) on ``host:port`` (0: a free one, read from
    :attr:`port`), bound here, served from :meth:`start` in a thread until :meth:`stop`.

    ``max_connections``: past this many open connections (handshake done) a request is
    answered 503 at once (uvicorn's ``limit_concurrency``). ``max_header_bytes``: longer
    request headers get 400. ``on_timeout`` counts connections cut for slow headers.
    Raises OSError when the address cannot be bound.
    """

    def __init__(
        self,
        app: ASGIApp,
        context: ssl.SSLContext | None,
        host: str,
        port: int,
        *,
        name: str,
        deadlines: Deadlines = Deadlines(),
        max_connections: int = 256,
        max_header_bytes: int = 8 * 1024,
        on_timeout: Callable[[], None] = lambda: None,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
            self._socket.listen(1024)
        except OSError:
            self._socket.close()
            raise
        self.port = int(self._socket.getsockname()[1])
        self.deadlines = deadlines
        config = uvicorn.Config(
            app,
            ws="none",  # no websockets: nothing to upgrade to, nothing to import
            interface="asgi3",  # said, not guessed: a bound method passes for ASGI2
            lifespan="off",
            proxy_headers=False,  # the peer's address is the socket's, never a header's
            # The process's logging stays the caller's: no dictConfig, no access log.
            log_config=None,
            access_log=False,
            http=_header_deadline(deadlines.headers_s, on_timeout),
            ssl_context_factory=None if context is None else (lambda _config, _default: context),
            timeout_keep_alive=deadlines.keep_alive_s,
            timeout_graceful_shutdown=1,
            limit_concurrency=max_connections,
            h11_max_incomplete_event_size=max_header_bytes,
        )
        self._server = uvicorn.Server(config)
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def _serve(self) -> None:
        loop = _HandshakeDeadlineLoop(self.deadlines.handshake_s)
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._socket]))
        except BaseException as exc:  # reported by start(), not lost in the thread
            self._failed = exc
            log.exception("%s stopped", self._thread.name)
        finally:
            loop.close()
            self._socket.close()

    def start(self, timeout_s: float = 10.0) -> None:
        """Serve; returns once connections are being accepted (RuntimeError if not)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)  # uvicorn exposes no event for "started"
        if not self._server.started:
            raise RuntimeError(f"{self._thread.name} did not start: {self._failed!r}")

    @property
    def running(self) -> bool:
        """Whether the serving thread is alive (it ends only by :meth:`stop` or a crash)."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every connection, and wait for the thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:
            self._socket.close()

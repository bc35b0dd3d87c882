"""The enrollment endpoint: HTTPS, served by `manager serve` beside gRPC (issue 13).

A device that holds no certificate yet cannot pass the broker's or gRPC's mutual TLS, so
it enrols here, over server-authenticated TLS (the fleet CA's "enroll" certificate; the
device pins the CA by the fingerprint in its token):

    GET  /v1/ca      the fleet CA certificate (public; the device checks its fingerprint)
    GET  /v1/crl     the fleet CA's CRL (public, signed by the CA: stations fetch it at each
                     renewal check and refuse revoked callers at their own endpoints,
                     edge_agent/identity/crl.py); 404 while none was issued
    POST /v1/enroll  an EnrollRequest (edge, token, CSR) -> an EnrollResponse, or
                     400 (malformed), 403 (token or CSR refused), 411 (no length),
                     413 (oversized), 408 (body too slow)
    POST /v1/renew   a RenewRequest (CSR for a new key) sent with the station's current
                     certificate as TLS client certificate -> an EnrollResponse; 401
                     without one, 403 for a revoked/foreign one or a CSR for another name
    POST /v1/confirm with the station's new certificate, no body, after the renewal's
                     swap -> {"revoked": N}: its older certificates are revoked at once
                     (:func:`enrollment.confirm`); 403 when it is not the newest

The port is open to the plant network, so no stranger may stall it (issue 24): uvicorn
serves it (:class:`GuardedServer`): each connection is an asyncio transport, not a thread;
a TLS handshake, the request's headers and its body each have a deadline; a body is at
most :data:`MAX_BODY` bytes, refused by its declared length before any of it is read, and
read in chunks, never more than that kept; one request per connection. The blocking
signing and database work runs in a worker thread, off the event loop.

Every refusal is counted by reason and changes nothing (:func:`enrollment.redeem` consumes
a token only when it issues). Tokens and CSRs are never logged.
"""

import asyncio
import json
import logging
import ssl
import threading
from collections import Counter
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security.credentials import EnrollmentError
from fedge.edge_manager.security.enrollment import confirm, redeem, renew
from fedge.protocols import codec
from fedge.protocols.enrollment import EnrollRequest, EnrollResponse, RenewRequest
from fedge.protocols.errors import ProtocolError
from fedge.transport.http_server import Deadlines, GuardedServer, presented_chain

log = logging.getLogger(__name__)
MAX_BODY = 16 * 1024
DEADLINES = Deadlines(handshake_s=10.0, headers_s=10.0, body_s=10.0, keep_alive_s=5)
# Open connections (handshake done) past which a request gets 503: far above a fleet
# enrolling at once, far below the process's file limit.
MAX_CONNECTIONS = 512


class EnrollServer:
    """The endpoint on ``host:port`` (0 = a free port, read from :attr:`port`), bound
    here (OSError when it cannot be), served from :meth:`start` in a thread of its own.
    ``deadlines``: how long a peer may take at each stage (tests shorten them)."""

    def __init__(
        self, home: ManagerHome, host: str, port: int, *, deadlines: Deadlines = DEADLINES
    ) -> None:
        self.home = home
        self.deadlines = deadlines
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # only the counters; never held across redeem()
        files = home.pki().server_files("enroll")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(str(files.cert), str(files.key))
        # Optional: a device enrolling has no certificate yet; one renewing presents its
        # current one, which OpenSSL checks against the fleet CA.
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cafile=str(files.ca))
        self._server = GuardedServer(
            self._app,
            context,
            host,
            port,
            name="enroll-https",
            deadlines=deadlines,
            max_connections=MAX_CONNECTIONS,
            on_timeout=lambda: self.count("timeout_headers"),
        )
        self.port = self._server.port

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    # -- the ASGI app: one request per connection, answered with `Connection: close`

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        response = await self._answer(request)
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    async def _answer(self, request: Request) -> Response:
        route = (request.method, request.url.path)
        if route == ("GET", "/v1/ca"):
            ca = await run_in_threadpool(self.home.pki().ca_path.read_bytes)
            return Response(ca, media_type="application/x-pem-file")
        if route == ("GET", "/v1/crl"):
            crl = await run_in_threadpool(_read_or_none, self.home.pki().crl_path)
            if crl is None:
                return self._refuse(404, "no_crl", "the fleet CA has issued no CRL yet")
            self.count("crl_served")
            return Response(crl, media_type="application/pkix-crl")
        if route == ("POST", "/v1/confirm"):
            return await self._confirm(request)
        if route not in (("POST", "/v1/enroll"), ("POST", "/v1/renew")):
            return _json(404, b"{}")
        peer = None
        if route[1] == "/v1/renew":
            chain = presented_chain(request.scope)
            if not chain:
                return self._refuse(401, "no_certificate", "renewal needs the current certificate")
            peer = chain[0].encode()
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        try:
            response: EnrollResponse
            if peer is None:
                enrollment = codec.decode(body, EnrollRequest, max_bytes=MAX_BODY)
                response = await run_in_threadpool(redeem, self.home, enrollment)
            else:
                renewal = codec.decode(body, RenewRequest, max_bytes=MAX_BODY)
                response = await run_in_threadpool(renew, self.home, peer, renewal)
        except ProtocolError as exc:
            return self._refuse(400, exc.reason, str(exc))
        except EnrollmentError as exc:
            return self._refuse(403, exc.reason, str(exc))
        kind = "enrolled" if peer is None else "renewed"
        self.count(kind)
        log.info("%s %s", kind, response.edge)
        return _json(200, codec.encode(response))

    async def _confirm(self, request: Request) -> Response:
        """A station confirms it holds its newest certificate (presented as its TLS client
        certificate; no body): older ones are revoked at once."""
        chain = presented_chain(request.scope)
        if not chain:
            return self._refuse(401, "no_certificate", "confirming needs the new certificate")
        try:
            revoked = await run_in_threadpool(confirm, self.home, chain[0].encode())
        except EnrollmentError as exc:
            return self._refuse(403, exc.reason, str(exc))
        self.count("confirmed")
        return _json(200, json.dumps({"revoked": len(revoked)}).encode())

    async def _body(self, request: Request) -> bytes | Response:
        """The request body, or the refusal: no declared length (411), more than
        MAX_BODY declared or sent (413, answered before reading it), not all sent within
        the body deadline (408)."""
        try:
            length = int(request.headers.get("content-length", ""))
        except ValueError:
            return self._refuse(411, "no_length", "Content-Length is required")
        if not 0 < length <= MAX_BODY:
            return self._refuse(413, "oversized", f"a request is at most {MAX_BODY} bytes")
        body = bytearray()
        try:
            async with asyncio.timeout(self.deadlines.body_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > MAX_BODY:  # h11 holds a body to its length; kept anyway
                        return self._refuse(413, "oversized", f"at most {MAX_BODY} bytes")
        except TimeoutError:
            return self._refuse(408, "slow_body", f"the body took over {self.deadlines.body_s:g} s")
        except ClientDisconnect:
            self.count("disconnected")
            return _json(400, b"{}")  # nobody is left to read it
        return bytes(body)

    def _refuse(self, status: int, reason: str, message: str) -> Response:
        self.count(f"refused_{reason}")
        log.warning("enrollment refused (%s): %s", reason, message)
        return _json(status, json.dumps({"error": reason, "message": message}).encode())


def _json(status: int, body: bytes) -> Response:
    return Response(body, status_code=status, media_type="application/json")


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None

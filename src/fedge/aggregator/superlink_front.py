"""The SuperLink's front: what stations (and anyone else on the plant network) reach.

Flower 1.41 serves the Fleet API (SuperNodes), the Control API (``flwr run``,
``flwr supernode register``) and the runtime API (its own ServerApps) on one HTTP port,
and the Control API has no authentication of its own in the open-source edition: whoever
reached that port could submit a run -- code that then runs on every station -- or
(un)register SuperNode keys (issue 24). So the SuperLink process itself listens on
loopback only, where the manager's own tools (``fedge aggregator run``, the key sync)
reach it, and this front listens where stations connect and passes on **only** Fleet API
calls (``POST /v1/fleet/...``); everything else is refused with 404 and counted, before
a byte reaches Flower.

The front also hands stations the fleet's signature on a FAB: on ``/v1/fleet/get-fab`` it
adds the signature ``fedge aggregator run`` stored for that FAB's digest
(:mod:`fedge.aggregator.signed_apps`) to the FAB's ``verifications``, where the station's
SuperNode, started with ``--trusted-entities``, checks it with Flower's own code. The
front holds no key and cannot make a signature: a FAB the manager did not sign reaches
stations unsigned and is refused there.

It speaks HTTPS with the SuperLink's certificate from the fleet CA (plain HTTP only for a
development home made ``--insecure``). SuperNodes present no client certificate (Flower's
SuperNode has none to give); each Fleet request is signed with the station's registered
key, which the SuperLink checks behind the front. Timeouts and a body limit keep one
client from holding the front: uvicorn handles connections on an event loop (an idle
socket holds no thread, and asyncio gives up a TLS handshake after 60 s), closes idle
keep-alive connections and caps how many it holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import threading
import time
from collections import Counter

import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from fedge.aggregator.job_dir import JobError
from fedge.aggregator.signed_apps import SignedApps
from fedge.protocols.app_signing import VALID_LICENSE
from fedge.protocols.pki import TlsFiles

log = logging.getLogger(__name__)

FLEET_PREFIX = "/v1/fleet/"
GET_FAB = "/v1/fleet/get-fab"
# Flower's own limit on a FAB is 10 MB; model arrays travel as objects Flower chunks.
# 64 MiB leaves room for a large model's object and refuses anything absurd.
MAX_BODY_BYTES = 64 * 1024 * 1024
UPSTREAM_TIMEOUT_S = 60.0
KEEP_ALIVE_S = 30
MAX_CONNECTIONS = 512
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
    }
)


class FrontError(JobError):
    """The SuperLink's front could not start."""


class FleetOnly:
    """The ASGI app: Fleet API calls go to ``upstream``; anything else is refused."""

    def __init__(
        self,
        upstream: str,
        verify: ssl.SSLContext | bool,
        signed_apps: SignedApps,
        *,
        max_body: int = MAX_BODY_BYTES,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.verify = verify
        self.signed_apps = signed_apps
        self.max_body = max_body
        self.counters: Counter[str] = Counter()
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # websockets: nothing of Flower's uses them here
            return
        request = Request(scope, receive)
        response = await self._handle(request)
        await response(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._client = httpx.AsyncClient(
                    base_url=self.upstream, verify=self.verify, timeout=UPSTREAM_TIMEOUT_S
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._client is not None:
                    await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _handle(self, request: Request) -> Response:
        path = request.url.path
        if not path.startswith(FLEET_PREFIX) or request.method != "POST" or ".." in path:
            self.counters["refused.not_fleet_api"] += 1
            log.warning(
                "refused %s %s from %s: this port serves only the Fleet API",
                request.method,
                path[:200],
                request.client.host if request.client else "?",
            )
            return JSONResponse(
                {"error": "not found: this port serves only Flower's Fleet API (stations)"},
                status_code=404,
            )
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            self.counters["refused.too_large"] += 1
            return JSONResponse({"error": "request body too large"}, status_code=413)
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > self.max_body:
                self.counters["refused.too_large"] += 1
                return JSONResponse({"error": "request body too large"}, status_code=413)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        assert self._client is not None, "the front serves only after its startup"
        try:
            upstream = await self._client.post(path, content=bytes(body), headers=headers)
        except httpx.HTTPError as exc:
            self.counters["upstream.unreachable"] += 1
            log.warning("the SuperLink behind the front did not answer %s: %s", path, exc)
            return JSONResponse({"error": "the SuperLink is not answering"}, status_code=502)
        self.counters["forwarded"] += 1
        content = upstream.content
        if path == GET_FAB and upstream.status_code == 200:
            content = self._with_signature(content)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    def _with_signature(self, content: bytes) -> bytes:
        """The GetFabResponse with the fleet's signature added, when there is one."""
        # Imported here: only the SuperLink's process, which has Flower, serves the front.
        from flwr.proto.fab_pb2 import GetFabResponse

        reply = GetFabResponse()
        try:
            reply.ParseFromString(content)
        except Exception:  # protobuf's DecodeError; Flower's own client will say more
            self.counters["fab.undecodable"] += 1
            return content
        digest = hashlib.sha256(reply.fab.content).hexdigest()
        signature = self.signed_apps.get(digest)
        if signature is None:
            self.counters["fab.unsigned"] += 1
            log.warning("FAB %s has no fleet signature: stations will refuse it", digest[:12])
            return content
        key_id, record = signature.verification()
        reply.fab.verifications.clear()
        reply.fab.verifications[VALID_LICENSE] = "Valid"
        reply.fab.verifications[key_id] = record
        self.counters["fab.signed"] += 1
        return reply.SerializeToString()


class SuperLinkFront:
    """:class:`FleetOnly` served by uvicorn on ``host:port`` in a thread of its own."""

    def __init__(
        self,
        host: str,
        port: int,
        upstream_port: int,
        signed_apps: SignedApps,
        *,
        tls: TlsFiles | None,
    ) -> None:
        self.host = host
        self.port = port
        scheme = "http" if tls is None else "https"
        verify: ssl.SSLContext | bool = False
        if tls is not None:
            verify = ssl.create_default_context(cafile=str(tls.ca))
        self.app = FleetOnly(f"{scheme}://127.0.0.1:{upstream_port}", verify, signed_apps)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            http="h11",
            timeout_keep_alive=KEEP_ALIVE_S,
            limit_concurrency=MAX_CONNECTIONS,
            timeout_graceful_shutdown=2,
            ssl_certfile=None if tls is None else str(tls.cert),
            ssl_keyfile=None if tls is None else str(tls.key),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="superlink-front", daemon=True)
        self._error: BaseException | None = None

    @property
    def counters(self) -> Counter[str]:
        return self.app.counters

    def _serve(self) -> None:
        try:
            asyncio.run(self._server.serve())
        except BaseException as exc:  # reported by start(); the thread must not die silently
            self._error = exc

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or self._error is not None:
                raise FrontError(
                    f"the SuperLink's front could not listen on {self.host}:{self.port}: "
                    f"{self._error or 'it stopped at start (port in use?)'}"
                )
            if time.monotonic() >= end:
                raise FrontError(f"the SuperLink's front did not listen within {timeout_s:.0f}s")
            time.sleep(0.05)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

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
(:mod:`fedge.aggregator.superlink.signed_apps`) to the FAB's ``verifications``, where the station's
SuperNode, started with ``--trusted-entities``, checks it with Flower's own code. The
front holds no key and cannot make a signature: a FAB the manager did not sign reaches
stations unsigned and is refused there.

**A station restarted within a minute rejoins at once** (issue 27). Flower keeps a node
online for twice its heartbeat interval (60 s) after its last heartbeat and refuses to
activate it again meanwhile (412, code 2004), so a SuperNode killed with its agent and
restarted was refused for about a minute, and a job started then ran without the station.
The front sees that refusal: when the key that asked is registered, it deactivates the
key's node and activates it again, for the SuperNode that asked. It does so with the
request's own node signature -- Flower's signature covers only a fresh timestamp
(``flwr/superlink/routers/fleet/node_auth.py``), so it already authorises any call of
that key's node for the next minutes -- and only for the node registered to that key,
only right after its holder asked to activate it: the newest SuperNode of a station wins.
A refusal it cannot lift carries the reason in Flower's public details
(:mod:`fedge.protocols.node_refusal`): the key is not registered (not enrolled, revoked,
renewed), or the node is still active and expires within a minute.

It speaks HTTPS with the SuperLink's certificate from the fleet CA (plain HTTP only for a
development home made ``--insecure``). SuperNodes present no client certificate (Flower's
SuperNode has none to give); each Fleet request is signed with the station's registered
key, which the SuperLink checks behind the front. So that a stranger cannot hold the front
either, it is served by :class:`~fedge.transport.http_server.GuardedServer` (deadlines on
the TLS handshake, the request headers and an idle connection; a cap on open
connections), and before it reads a body it refuses a request that is not one of the
Fleet API's routes, that lacks the node signature headers every SuperNode request carries
(with node authentication on), or whose declared body is larger than its route may carry
(only pushed messages and objects may be large); the body itself must arrive within a
deadline. Headers that would claim another client address (``X-Forwarded-For``, ...) are
dropped and the real peer's address is passed on, so the SuperLink's log names it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import ssl
from collections import Counter
from collections.abc import Callable, Mapping

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from fedge.aggregator.jobs.directory import JobError
from fedge.aggregator.superlink.signed_apps import SignedApps
from fedge.protocols.app_signing import VALID_LICENSE
from fedge.protocols.node_refusal import KEY_NOT_REGISTERED_DETAIL, still_active_detail
from fedge.protocols.pki import TlsFiles
from fedge.transport.http_server import Deadlines, GuardedServer

log = logging.getLogger(__name__)

FLEET_PREFIX = "/v1/fleet/"
GET_FAB = "/v1/fleet/get-fab"
ACTIVATE = "/v1/fleet/activate-node"
DEACTIVATE = "/v1/fleet/deactivate-node"
PRECONDITION_FAILED = 412
NODE_ACTIVATION_FAILED = 2004  # flwr.supercore.error.ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED
NODE_ONLINE_S = 60.0  # Flower: HEARTBEAT_PATIENCE (2) x HEARTBEAT_DEFAULT_INTERVAL (30 s)
RegisteredNodes = Callable[[], Mapping[bytes, int]]
"""The registered SuperNode keys (PEM SubjectPublicKeyInfo, as Flower sends them) -> node id."""
# Flower 1.41's Fleet API: everything a SuperNode calls, nothing else.
FLEET_ROUTES = frozenset(
    FLEET_PREFIX + name
    for name in (
        "register-node",
        "activate-node",
        "deactivate-node",
        "unregister-node",
        "send-node-heartbeat",
        "pull-messages",
        "push-messages",
        "get-run",
        "get-fab",
        "push-object",
        "pull-object",
        "confirm-message-received",
    )
)
# Model arrays travel as objects Flower chunks, and replies as pushed messages: these may
# be large (64 MiB leaves room for a large model's object and refuses anything absurd);
# every other call is a small request.
LARGE_ROUTES = frozenset({FLEET_PREFIX + "push-object", FLEET_PREFIX + "push-messages"})
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_SMALL_BODY_BYTES = 64 * 1024
# Flower's SuperNode signs every Fleet request (node authentication).
NODE_AUTH_HEADERS = ("flwr-public-key", "flwr-signature", "flwr-timestamp")
UPSTREAM_TIMEOUT_S = 60.0
# SuperNodes poll every few seconds: a kept-alive connection saves them a TLS handshake.
DEADLINES = Deadlines(handshake_s=10.0, headers_s=10.0, body_s=30.0, keep_alive_s=30)
MAX_CONNECTIONS = 512
_NOT_FORWARDED = frozenset(
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
        # A client's claim of where it is: the front says that itself.
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "x-real-ip",
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
        node_auth: bool = True,
        registered: RegisteredNodes | None = None,
        max_body: int = MAX_BODY_BYTES,
        max_small_body: int = MAX_SMALL_BODY_BYTES,
        body_s: float = DEADLINES.body_s,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.verify = verify
        self.signed_apps = signed_apps
        self.node_auth = node_auth
        self.registered = registered
        self.max_body = max_body
        self.max_small_body = max_small_body
        self.body_s = body_s
        self.counters: Counter[str] = Counter()
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # no lifespan, no websockets here
            return
        request = Request(scope, receive)
        response = await self._handle(request)
        await response(scope, receive, send)

    def _refuse(self, reason: str, status: int, message: str) -> Response:
        self.counters[f"refused.{reason}"] += 1
        return JSONResponse({"error": message}, status_code=status)

    async def _handle(self, request: Request) -> Response:
        path = request.url.path
        peer = request.client.host if request.client else "?"
        if request.method != "POST" or path not in FLEET_ROUTES:
            log.warning(
                "refused %s %s from %s: this port serves only the Fleet API",
                request.method,
                path[:200],
                peer,
            )
            return self._refuse(
                "not_fleet_api", 404, "not found: this port serves only Flower's Fleet API"
            )
        if self.node_auth and not all(request.headers.get(h) for h in NODE_AUTH_HEADERS):
            return self._refuse("unsigned", 401, "Fleet API calls must be signed by a SuperNode")
        limit = self.max_body if path in LARGE_ROUTES else self.max_small_body
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit():
            return self._refuse("no_length", 411, "a Fleet API call states its length")
        if int(declared) > limit:
            return self._refuse("too_large", 413, "request body too large")
        try:
            body = await asyncio.wait_for(self._read(request, limit), self.body_s)
        except TimeoutError:
            return self._refuse("slow_body", 408, "the request body did not arrive in time")
        if body is None:
            return self._refuse("too_large", 413, "request body too large")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers["x-forwarded-for"] = peer
        if self._client is None:  # made in the serving loop, on its first request
            self._client = httpx.AsyncClient(
                base_url=self.upstream, verify=self.verify, timeout=UPSTREAM_TIMEOUT_S
            )
        try:
            upstream = await self._client.post(path, content=body, headers=headers)
        except httpx.HTTPError as exc:
            self.counters["upstream.unreachable"] += 1
            log.warning("the SuperLink behind the front did not answer %s: %s", path, exc)
            return JSONResponse({"error": "the SuperLink is not answering"}, status_code=502)
        self.counters["forwarded"] += 1
        if path == ACTIVATE and upstream.status_code == PRECONDITION_FAILED:
            upstream = await self._refused_activation(body, headers, upstream, peer)
        content = upstream.content
        if path == GET_FAB and upstream.status_code == 200:
            content = self._with_signature(content)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FORWARDED}
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    async def _refused_activation(
        self, body: bytes, headers: dict[str, str], refusal: httpx.Response, peer: str
    ) -> httpx.Response:
        """A refused ActivateNode: reactivated when the key's old node is what stands in
        the way, else the refusal with its reason (see the module's docstring)."""
        if (
            self.registered is None
            or self._client is None
            or _error_code(refusal) != (NODE_ACTIVATION_FAILED)
        ):
            return refusal
        # Imported here: only the SuperLink's process, which has Flower, serves the front.
        from flwr.proto.fleet_pb2 import ActivateNodeRequest, DeactivateNodeRequest

        request = ActivateNodeRequest()
        try:
            request.ParseFromString(body)
            node_id = self.registered().get(bytes(request.public_key))
        except Exception as exc:  # a DecodeError, or an unreadable list of keys
            log.warning("cannot tell why activation from %s was refused: %s", peer, exc)
            return refusal
        if node_id is None:
            self.counters["activation.not_registered"] += 1
            log.warning("refused to activate a SuperNode from %s: key not registered", peer)
            return _with_detail(refusal, KEY_NOT_REGISTERED_DETAIL)
        try:
            released = await self._client.post(
                DEACTIVATE,
                content=DeactivateNodeRequest(node_id=node_id).SerializeToString(),
                headers=headers,
            )
            again = await self._client.post(ACTIVATE, content=body, headers=headers)
        except httpx.HTTPError as exc:
            log.warning("could not reactivate node %s for %s: %s", node_id, peer, exc)
            return _with_detail(refusal, still_active_detail(node_id, NODE_ONLINE_S))
        if again.status_code == 200:
            self.counters["activation.reclaimed"] += 1
            log.info(
                "node %s was still active on the SuperLink: deactivated and activated again "
                "for the SuperNode that asked (from %s)",
                node_id,
                peer,
            )
            return again
        self.counters["activation.still_active"] += 1
        log.warning(
            "node %s is still active and could not be released (deactivate: %s, activate: %s)",
            node_id,
            released.status_code,
            again.status_code,
        )
        return _with_detail(refusal, still_active_detail(node_id, NODE_ONLINE_S))

    @staticmethod
    async def _read(request: Request, limit: int) -> bytes | None:
        """The body, or None past ``limit`` (a peer that sends more than it declared)."""
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                return None
        return bytes(body)

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


def _error_code(response: httpx.Response) -> int | None:
    """The Flower error code in a refusal's JSON body (``{"code": ..., "detail": ...}``)."""
    try:
        payload = json.loads(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    code = payload.get("code") if isinstance(payload, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def _with_detail(refusal: httpx.Response, detail: str) -> httpx.Response:
    """The refusal with ``detail`` as Flower's public details (``extra``), which the
    SuperNode prints under the error's code."""
    payload = json.loads(refusal.content)
    payload["extra"] = detail
    headers = {k: v for k, v in refusal.headers.items() if k.lower() not in _NOT_FORWARDED}
    return httpx.Response(
        refusal.status_code, headers=headers, content=json.dumps(payload).encode()
    )


class SuperLinkFront:
    """:class:`FleetOnly` on ``host:port``, served by a :class:`GuardedServer`."""

    def __init__(
        self,
        host: str,
        port: int,
        upstream_port: int,
        signed_apps: SignedApps,
        *,
        tls: TlsFiles | None,
        node_auth: bool = True,
        registered: RegisteredNodes | None = None,
    ) -> None:
        self.host = host
        self.port = port
        scheme = "http" if tls is None else "https"
        verify: ssl.SSLContext | bool = False
        context = None
        if tls is not None:
            verify = ssl.create_default_context(cafile=str(tls.ca))
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(str(tls.cert), str(tls.key))
        self.app = FleetOnly(
            f"{scheme}://127.0.0.1:{upstream_port}",
            verify,
            signed_apps,
            node_auth=node_auth and tls is not None,
            registered=registered,
        )
        try:
            self._server = GuardedServer(
                self.app,
                context,
                host,
                port,
                name="superlink-front",
                deadlines=DEADLINES,
                max_connections=MAX_CONNECTIONS,
                on_timeout=lambda: self.counters.update(["refused.slow_headers"]),
            )
        except OSError as exc:
            raise FrontError(
                f"the SuperLink's front cannot listen on {host}:{port}: {exc}"
            ) from None
        self._started = False

    @property
    def counters(self) -> Counter[str]:
        return self.app.counters

    def start(self, timeout_s: float = 30.0) -> None:
        try:
            self._server.start(timeout_s)
        except RuntimeError as exc:
            raise FrontError(f"the SuperLink's front did not start: {exc}") from None
        self._started = True

    @property
    def running(self) -> bool:
        return self._started and self._server.running

    def stop(self) -> None:
        self._server.stop()

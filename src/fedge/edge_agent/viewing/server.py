"""The station's image endpoint: HTTPS with mutual TLS, for the manager's certificate only.

    GET /v1/images/{prediction_id}  -> the kept image's bytes (Content-Type by suffix)
                                       or a refusal: JSON {"error", "reason"} with the
                                       reason also in X-Fedge-Refusal (protocols/viewing.py)

The TLS layer admits only certificates from the fleet's CA (the station's own CA file);
:func:`~fedge.edge_agent.viewing.policy.decide` then wants a certificate the fleet's CRL
at the station does not revoke (edge_agent/identity/crl.py), the manager's role and the
station's own signed config allowing operator viewing, every time (a config turned off is
in force for the next request). Every image sent and every refusal is counted in the
agent's counters (``images.sent``, ``images.bytes_sent``, ``images.refused.<reason>``),
which ``/v1/status`` shows: the station's own account of what left it.

Each connection is handled in its own thread with a socket timeout, and its TLS handshake
runs there too: a peer that never shakes hands stalls only its own thread.
"""

import json
import logging
import ssl
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socket import socket
from typing import Any

from cryptography import x509

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.errors import AgentError, SettingsError
from fedge.edge_agent.identity.crl import StationRevocations, crl_path
from fedge.edge_agent.viewing.policy import ImageFacts, decide, viewing_on
from fedge.party.errors import StationDataError
from fedge.protocols import pki, validate
from fedge.protocols.config import EdgeConfig
from fedge.protocols.errors import ProtocolError
from fedge.protocols.pki import CertificateError, Role, TlsFiles
from fedge.protocols.viewing import (
    IMAGE_PATH,
    MAX_IMAGE_BYTES,
    MEDIA_TYPES,
    REASON_HEADER,
    STATUS,
    Refusal,
)
from fedge.transport.metrics import ServerTlsContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StationImages:
    """What the endpoint reads of the agent: plain callables, no agent object."""

    config: Callable[[], EdgeConfig | None]  # the applied signed config
    known: Callable[[str], bool]  # the station scored this prediction
    kept: Callable[[str], tuple[Path, int] | None]  # its kept image, if still kept
    counters: Counter[str]
    # Whether the fleet's CRL revokes a serial (CertificateError: it cannot be checked).
    revoked: Callable[[int], bool] = lambda serial: False


class _Handler(BaseHTTPRequestHandler):
    images: StationImages

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("images: " + format, *args)

    def do_GET(self) -> None:
        counters = self.images.counters
        prediction_id = self.path.split("?", 1)[0].removeprefix(IMAGE_PATH)
        try:
            if not self.path.startswith(IMAGE_PATH):
                raise ProtocolError(f"no route {self.path[:100]}")
            validate.identifier(prediction_id, "prediction_id")
            kept = self.images.kept(prediction_id)
        except (ProtocolError, StationDataError, ValueError) as exc:
            self._refuse(Refusal.BAD_REQUEST, str(exc))
            return
        caller, revoked = self._caller()
        facts = ImageFacts(
            caller=caller,
            revoked=revoked,
            viewing_on=viewing_on(self.images.config()),
            known=self.images.known(prediction_id),
            kept_bytes=None if kept is None else kept[1],
        )
        refusal = decide(facts)
        data = b""
        if refusal is None and kept is not None:
            try:
                data = kept[0].read_bytes()
            except OSError:  # retention removed it between the row and the read
                refusal = Refusal.PRUNED
            if len(data) > MAX_IMAGE_BYTES:
                refusal = Refusal.TOO_LARGE
        if refusal is not None or kept is None:
            self._refuse(refusal or Refusal.PRUNED, _reason(refusal or Refusal.PRUNED))
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", MEDIA_TYPES.get(kept[0].suffix.lower(), "image/png"))
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)
        counters["images.sent"] += 1
        counters["images.bytes_sent"] += len(data)
        log.info("images: sent %s (%d bytes) to the manager", prediction_id, len(data))

    def _caller(self) -> tuple[Role | None, bool]:
        """The caller's role, and whether its certificate is revoked (True also when the
        station's CRL is unusable: a broken list admits nobody)."""
        connection = self.connection
        if not isinstance(connection, ssl.SSLSocket):
            return None, False
        der = connection.getpeercert(binary_form=True)
        if der is None:
            return None, False
        try:
            info = pki.cert_info(x509.load_der_x509_certificate(der))
        except (ValueError, ProtocolError):
            return None, False
        try:
            revoked = self.images.revoked(info.serial)
        except CertificateError as exc:
            log.warning("images: revocation cannot be checked, refusing everyone: %s", exc)
            self.images.counters["images.crl_unusable"] += 1
            revoked = True
        return info.role, revoked

    def _refuse(self, refusal: Refusal, message: str) -> None:
        self.images.counters[f"images.refused.{refusal.value}"] += 1
        log.info("images: refused %s: %s", refusal.value, message)
        body = json.dumps({"error": message, "reason": refusal.value}).encode()
        self.send_response(STATUS[refusal])
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header(REASON_HEADER, refusal.value)
        self.end_headers()
        self.wfile.write(body)


def _reason(refusal: Refusal) -> str:
    return {
        Refusal.NOT_MANAGER: "only the manager's certificate may fetch this station's images",
        Refusal.REVOKED: (
            "the fleet's revocation list at this station revokes the caller's certificate "
            "(or the station's list is unusable until it fetches a good one)"
        ),
        Refusal.POLICY_OFF: (
            "this station's signed config does not allow operator viewing; its images stay "
            "on it (an admin can allow viewing on its edge page)"
        ),
        Refusal.UNKNOWN: "this station scored no such prediction",
        Refusal.PRUNED: "the station's retention has removed this image",
        Refusal.TOO_LARGE: f"the image is over {MAX_IMAGE_BYTES} bytes",
    }.get(refusal, refusal.value)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    timeout_s = 10.0  # a stalled peer costs its thread a bounded time

    def __init__(
        self, address: tuple[str, int], handler: type[_Handler], context: ServerTlsContext
    ) -> None:
        self.context = context
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket, Any]:
        conn, address = super().get_request()
        conn.settimeout(self.timeout_s)
        conn = self.context.current().wrap_socket(
            conn, server_side=True, do_handshake_on_connect=False
        )
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("images: connection from %s failed", client_address, exc_info=True)


class ImageServer:
    """The endpoint bound to ``host:port`` (0: a free one) at construction, serving from
    :meth:`start` until :meth:`stop`. ``address`` is what the station's birth states."""

    def __init__(
        self, images: StationImages, files: TlsFiles, host: str, port: int, advertised: str = ""
    ) -> None:
        try:
            # Follows the files: the station's renewed certificate is served at once.
            context = ServerTlsContext(files)
        except (OSError, ssl.SSLError) as exc:
            raise AgentError(f"cannot load the station's TLS files for images: {exc}") from None
        handler = type("ImageHandler", (_Handler,), {"images": images})
        try:
            self._server = _Server((host, port), handler, context)
        except OSError as exc:
            raise AgentError(
                f"cannot serve images on {host} port {port}: {exc.strerror}; set image_port "
                "in agent.toml to a free port (0 turns it off)"
            ) from None
        bound = int(self._server.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        self.address = advertised or f"{shown}:{bound}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="images", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


def bind_image_server(agent: EdgeAgent) -> ImageServer | None:
    """The agent's image endpoint as agent.toml sets it (None: image_port = 0), bound, not
    serving yet; the agent's births state its address from now on."""
    settings = agent.settings
    if not settings.image_port:
        return None
    files = settings.tls()
    if files is None:
        raise SettingsError("image_port needs mutual TLS; an insecure station serves no images")
    images = StationImages(
        config=lambda: agent.config,
        known=agent.store.has_prediction,
        kept=agent.station.image,
        counters=agent.counters,
        revoked=StationRevocations(crl_path(files), files.ca).revoked,
    )
    server = ImageServer(
        images, files, settings.image_host, settings.image_port, settings.image_address
    )
    agent.images_at = server.address
    return server

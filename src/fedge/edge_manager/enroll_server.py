"""The enrollment endpoint: HTTPS, served by `manager serve` beside gRPC (issue 13).

A device that holds no certificate yet cannot pass the broker's or gRPC's mutual TLS, so
it enrols here, over server-authenticated TLS (the fleet CA's "enroll" certificate; the
device pins the CA by the fingerprint in its token):

    GET  /v1/ca      the fleet CA certificate (public; the device checks its fingerprint)
    POST /v1/enroll  an EnrollRequest (edge, token, CSR) -> an EnrollResponse, or
                     400 (malformed), 403 (token or CSR refused), 413 (oversized)
    POST /v1/renew   a RenewRequest (CSR for a new key) sent with the station's current
                     certificate as TLS client certificate -> an EnrollResponse; 401
                     without one, 403 for a revoked/foreign one or a CSR for another name

Every refusal is counted by reason and changes nothing (:func:`enrollment.redeem` consumes
a token only when it issues). Tokens and CSRs are never logged.
"""

import http.server
import json
import logging
import ssl
import threading
from collections import Counter
from typing import Any

from fedge.edge_manager.credentials import EnrollmentError
from fedge.edge_manager.enrollment import redeem, renew
from fedge.edge_manager.home import ManagerHome
from fedge.protocols import codec
from fedge.protocols.enrollment import EnrollRequest, RenewRequest
from fedge.protocols.errors import ProtocolError

log = logging.getLogger(__name__)
MAX_BODY = 16 * 1024


class EnrollServer:
    """An HTTPS server on ``host:port`` (0 = a free port) in a thread of its own."""

    def __init__(self, home: ManagerHome, host: str, port: int) -> None:
        self.home = home
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
        self._httpd = http.server.ThreadingHTTPServer((host, port), self._handler())
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="enroll-https", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug("enroll %s", format % args)  # paths only; bodies never logged

            def _reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _refuse(self, status: int, reason: str, message: str) -> None:
                server.count(f"refused_{reason}")
                log.warning("enrollment refused (%s): %s", reason, message)
                self._reply(status, json.dumps({"error": reason, "message": message}).encode())

            def do_GET(self) -> None:
                if self.path != "/v1/ca":
                    self._reply(404, b"{}")
                    return
                self._reply(200, server.home.pki().ca_path.read_bytes(), "application/x-pem-file")

            def _body(self) -> bytes | None:
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self._refuse(411, "no_length", "Content-Length is required")
                    return None
                if not 0 < length <= MAX_BODY:
                    self._refuse(413, "oversized", f"a request is at most {MAX_BODY} bytes")
                    return None
                return bytes(self.rfile.read(length))

            def do_POST(self) -> None:
                if self.path not in ("/v1/enroll", "/v1/renew"):
                    self._reply(404, b"{}")
                    return
                body = self._body()
                if body is None:
                    return
                try:
                    if self.path == "/v1/enroll":
                        request = codec.decode(body, EnrollRequest, max_bytes=MAX_BODY)
                        edge = request.edge
                        response = redeem(server.home, request)
                    else:
                        peer = self._peer_certificate()
                        if peer is None:
                            return
                        renewal = codec.decode(body, RenewRequest, max_bytes=MAX_BODY)
                        response = renew(server.home, peer, renewal)
                        edge = response.edge
                except ProtocolError as exc:
                    self._refuse(400, exc.reason, str(exc))
                    return
                except EnrollmentError as exc:
                    self._refuse(403, exc.reason, str(exc))
                    return
                kind = "enrolled" if self.path == "/v1/enroll" else "renewed"
                server.count(kind)
                log.info("%s %s", kind, edge)
                self._reply(200, codec.encode(response))

            def _peer_certificate(self) -> bytes | None:
                connection = self.connection
                der = (
                    connection.getpeercert(binary_form=True)
                    if isinstance(connection, ssl.SSLSocket)
                    else None
                )
                if not der:
                    self._refuse(401, "no_certificate", "renewal needs the current certificate")
                    return None
                return ssl.DER_cert_to_PEM_cert(der).encode()

        return Handler

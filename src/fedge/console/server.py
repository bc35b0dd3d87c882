"""Serving the console with uvicorn: one process, bound to 127.0.0.1 unless told otherwise,
over HTTPS with a certificate from the fleet CA when asked (``tls``)."""

import asyncio
import ssl
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from fedge.console.address import DEFAULT_HOST, DEFAULT_PORT, is_loopback
from fedge.console.app import create_app
from fedge.edge_manager.home import ManagerHome


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


def serve(
    home: ManagerHome,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    announce: Callable[[str], None] = lambda url: None,
    *,
    tls: bool = False,
) -> None:
    """Serve until interrupted; ``announce`` gets the URL once the home has been opened.

    ``tls``: HTTPS with the fleet CA's ``console`` server certificate (issued on first
    use, naming the manager's hosts and ``host``); browsers must trust the fleet CA
    (``<home>/pki/ca.crt``). Raises ManagerError for a directory that is no manager home,
    or, with ``tls``, one without a fleet CA.
    """
    settings = home.settings()  # a missing or broken home fails here, with its own message
    files = home.pki().served_files("console", [*settings.server_hosts(), host]) if tls else None
    # HSTS binds a host name on every port: not sent for loopback, where the plain-HTTP
    # console of `make console` also runs.
    app = create_app(home, https=tls, hsts=tls and not is_loopback(host))
    announce(f"{'https' if tls else 'http'}://{host}:{port}/")
    # No access log: URLs carry no secrets, but a console log is not the audit log, and
    # keeping one would only invite that mistake. Open live-update streams are cut after
    # a second on shutdown instead of holding Ctrl-C up.
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
        ssl_certfile=None if files is None else str(files.cert),
        ssl_keyfile=None if files is None else str(files.key),
        # Over TLS a browser may present an operator certificate (cert_login.py); the
        # fleet CA is the only one trusted for it, and a token login needs none.
        ssl_cert_reqs=ssl.CERT_NONE if files is None else ssl.CERT_OPTIONAL,
        ssl_ca_certs=None if files is None else str(files.ca),
        http=ClientCertH11 if files is not None else "auto",
    )

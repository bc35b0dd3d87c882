"""Serving the console with uvicorn: one process, bound to 127.0.0.1 unless told otherwise,
over HTTPS with a certificate from the fleet CA when asked (``tls``)."""

import ssl
from collections.abc import Callable

import uvicorn

from fedge.console.address import DEFAULT_HOST, DEFAULT_PORT, is_loopback
from fedge.console.app import create_app
from fedge.edge_manager.home.layout import ManagerHome
from fedge.transport.http_server import ClientCertH11


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

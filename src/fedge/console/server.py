"""Serving the console with uvicorn: one process, bound to 127.0.0.1 unless told otherwise."""

from collections.abc import Callable

import uvicorn

from fedge.console.address import DEFAULT_HOST, DEFAULT_PORT
from fedge.console.app import create_app
from fedge.edge_manager.home import ManagerHome


def serve(
    home: ManagerHome,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    announce: Callable[[str], None] = lambda url: None,
) -> None:
    """Serve until interrupted; ``announce`` gets the URL once the home has been opened.

    Raises ManagerError for a directory that is no manager home.
    """
    home.settings()  # a missing or broken home fails here, with its own message
    app = create_app(home)
    announce(f"http://{host}:{port}/")
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
    )

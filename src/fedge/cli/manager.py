"""``fedge manager``: create a home, run the broker, serve the control plane."""

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from fedge.cli import operator, retention
from fedge.cli.common import DEFAULT_HOME, HomeOption, console, friendly_errors, setup_logging
from fedge.edge_manager.enrollment import managed_broker
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home import ManagerHome, ManagerSettings
from fedge.edge_manager.service import ManagerService

app = typer.Typer(help="The fleet's control plane.", no_args_is_help=True)
app.add_typer(operator.app, name="operator")


@app.command()
@friendly_errors
def init(
    fleet: Annotated[str, typer.Option(help="Fleet id, e.g. plant-a.")],
    home: HomeOption = DEFAULT_HOME,
    broker_host: str = "127.0.0.1",
    broker_port: int = 1883,
    grpc_host: str = "127.0.0.1",
    grpc_port: int = 50551,
    superlink_host: str = "127.0.0.1",
    superlink_port: int = 9092,
) -> None:
    """Create a manager home with a fresh signing key.

    Example: fedge manager init --fleet plant-a --home ./fedge-home
    """
    manager_home = ManagerHome(home)
    manager_home.init(
        ManagerSettings(
            fleet,
            broker_host,
            broker_port,
            grpc_host,
            grpc_port,
            superlink_host=superlink_host,
            superlink_port=superlink_port,
        )
    )
    console.print(f"manager home for fleet [bold]{fleet}[/bold] created in {home}")
    console.print(f"public key (pin it on agents): {manager_home.public_key_path}")


@app.command()
@friendly_errors
def broker(home: HomeOption = DEFAULT_HOME) -> None:
    """Run the fleet's Mosquitto (auth + per-edge ACLs) in the foreground.

    Example: fedge manager broker --home ./fedge-home
    """
    mosquitto = managed_broker(ManagerHome(home))
    # Handlers first (a SIGTERM during start must still stop the broker), and they only
    # set a flag: stopping from inside one would re-enter Popen's lock and deadlock.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    mosquitto.start()
    console.print(f"mosquitto listening on {mosquitto.host}:{mosquitto.port}")
    while not stop.wait(0.5):
        if not mosquitto.running:
            raise ManagerError(f"mosquitto exited; see {mosquitto.log_path}")
    mosquitto.stop()


@app.command()
@friendly_errors
def serve(
    home: HomeOption = DEFAULT_HOME,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    ready_file: Annotated[Path | None, typer.Option(help="Touch this file once serving.")] = None,
) -> None:
    """Ingest reports, publish desired documents, serve models over gRPC.

    Example: fedge manager serve --home ./fedge-home
    """
    setup_logging(verbose)
    service = ManagerService(ManagerHome(home))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service.start()
    console.print(f"manager serving fleet {service.settings.fleet}; gRPC on {service.grpc_port}")
    if ready_file is not None:
        ready_file.write_text(str(service.grpc_port))
    stop.wait()
    service.stop()


@app.command()
@friendly_errors
def superlink(home: HomeOption = DEFAULT_HOME) -> None:
    """Run the fleet's Flower SuperLink (stations' SuperNodes and fleet jobs meet here).

    Example: fedge manager superlink --home ./fedge-home
    """
    from fedge.aggregator.superlink import SuperLink

    manager_home = ManagerHome(home)
    settings = manager_home.settings()
    link = SuperLink(
        manager_home.root / "superlink", settings.superlink_host, settings.superlink_port
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    link.start()
    console.print(f"SuperLink listening on port {settings.superlink_port} (log {link.log_path})")
    while not stop.wait(0.5):
        if not link.running:
            raise ManagerError(f"the SuperLink exited; see {link.log_path}")
    link.stop()


app.command("watch")(operator.watch)
app.command("prune")(retention.prune)

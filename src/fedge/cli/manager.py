"""``fedge manager``: create a home, run the broker, serve the control plane."""

import os
import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from fedge.cli import backup, keys, operator, retention
from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    err_console,
    friendly_errors,
    print_json,
    setup_logging,
)
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home import launcher
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.edge_manager.home.run_dir import (
    BrokerLink,
    Role,
    ServeState,
    broker_link,
    hold,
    log_path,
    write_serve_state,
)
from fedge.edge_manager.home.space import require_writable_store
from fedge.edge_manager.security.enrollment import managed_broker
from fedge.edge_manager.serve import ManagerService

app = typer.Typer(help="The fleet's control plane.", no_args_is_help=True)
app.add_typer(operator.app, name="operator")
app.command(name="backup")(backup.backup)
app.command(name="restore")(backup.restore)


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
    advertise_host: Annotated[
        str,
        typer.Option(
            help="The host agents reach this manager at (written into their agent.toml), "
            "needed when a bind host is 0.0.0.0."
        ),
    ] = "",
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Plain TCP listeners with passwords instead of mutual TLS (development only).",
        ),
    ] = False,
    enroll_port: Annotated[int, typer.Option(help="The enrollment endpoint's port.")] = 8444,
    broker_persistence: Annotated[
        Path | None,
        typer.Option(
            help="Directory of the broker's save file (default: <home>/broker/data, on the "
            "store's disk); another file system keeps it safe when the store's disk fills."
        ),
    ] = None,
) -> None:
    """Create a manager home: a signing key, and the fleet CA with server certificates.

    Set FEDGE_CA_PASSPHRASE to keep the CA key encrypted (give it to `manager serve` too).

    Example: fedge manager init --fleet plant-a --broker-host 0.0.0.0 --advertise-host mgr.lan
    """
    settings = ManagerSettings(
        fleet,
        broker_host,
        broker_port,
        grpc_host,
        grpc_port,
        superlink_host=superlink_host,
        superlink_port=superlink_port,
        advertise_host=advertise_host,
        insecure=insecure,
        enroll_port=enroll_port,
        broker_persistence="" if broker_persistence is None else str(broker_persistence.absolute()),
    )
    problem = settings.agent_address_problem(fix="give it with --advertise-host HOST")
    if problem is not None:  # refused now rather than at the first `fedge edge enroll`
        raise ManagerError(problem)
    manager_home = ManagerHome(home)
    manager_home.init(settings)
    console.print(f"manager home for fleet [bold]{escape(fleet)}[/bold] created in {home}")
    console.print(f"public key (pin it on agents): {manager_home.public_key_path}")
    if insecure:
        err_console.print(
            "[yellow]warning:[/yellow] --insecure: plain TCP and passwords; for development only"
        )
    else:
        console.print(
            f"fleet CA {manager_home.pki().ca_fingerprint()} (mutual TLS on every listener)",
            highlight=False,
        )
    console.print(f"agents are given {escape(settings.agent_grpc_target)} (gRPC)", highlight=False)
    console.print(
        f"the broker saves its state in {manager_home.broker_persistence_dir} "
        "(--broker-persistence to move it)",
        highlight=False,
    )


@app.command()
@friendly_errors
def advertise(
    host: Annotated[str, typer.Argument(help="Host name or address agents reach this at.")],
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Set the host agents are given in their agent.toml and deployments.

    Edges enrolled before keep their old address until enrolled again (`fedge edge enroll`).

    Example: fedge manager advertise mgr.plant-a.lan
    """
    settings = ManagerHome(home).advertise(host)
    addresses = (
        f"agents are given broker {settings.agent_broker_host} port {settings.broker_port}, "
        f"gRPC {settings.agent_grpc_target}, SuperLink {settings.agent_superlink}"
    )
    console.print(escape(addresses), highlight=False)


@app.command()
@friendly_errors
def broker(home: HomeOption = DEFAULT_HOME) -> None:
    """Run the fleet's Mosquitto (auth + per-edge ACLs) in the foreground.

    Example: fedge manager broker --home ./fedge-home
    """
    lock_fd = hold(home, Role.BROKER)  # one broker per home, held until the process ends
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
    os.close(lock_fd)


@app.command()
@friendly_errors
def serve(
    home: HomeOption = DEFAULT_HOME,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    ready_file: Annotated[Path | None, typer.Option(help="Touch this file once serving.")] = None,
    broker_wait: Annotated[
        float, typer.Option(help="Seconds to wait for the broker before saying it is missing.")
    ] = 5.0,
) -> None:
    """Ingest reports, publish desired documents, serve models over gRPC.

    One per home. Its broker connection is kept in <home>/run/serve.json (see
    `fedge manager status`).

    Example: fedge manager serve --home ./fedge-home
    """
    setup_logging(verbose)
    require_writable_store(ManagerHome(home).db_path)  # before the lock, which writes there too
    lock_fd = hold(home, Role.SERVE)  # a second serve would fight this one for the broker
    service = ManagerService(ManagerHome(home))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service.start()
    settings = service.settings
    address = f"{settings.broker_host}:{settings.broker_port}"
    service.mqtt.connected.wait(broker_wait)
    state = _serve_state(service, address)
    write_serve_state(home, state)
    if state.broker is BrokerLink.CONNECTED:
        console.print(
            f"manager serving fleet {settings.fleet}: gRPC on {service.grpc_port}, "
            f"broker {address} connected"
        )
    else:
        # Not "serving": without the broker no edge hears a push and MQTT reports stop.
        err_console.print(
            f"[yellow]warning:[/yellow] manager of fleet {settings.fleet} is up (gRPC on "
            f"{service.grpc_port}) but the broker at {address} is not reachable"
            f"{escape(_why(state))}; retrying. Desired documents wait and edges report over "
            "gRPC only until it is; is `fedge manager broker` running?",
            highlight=False,
        )
    if ready_file is not None:
        ready_file.write_text(str(service.grpc_port))
    while not stop.wait(0.5):
        current = _serve_state(service, address)
        if current != state:
            write_serve_state(home, current)
            state = current
    service.stop()
    os.close(lock_fd)


def _why(state: ServeState) -> str:
    return f" ({state.broker_detail})" if state.broker_detail else ""


def _serve_state(service: ManagerService, address: str) -> ServeState:
    link = service.mqtt.link
    return ServeState(
        pid=os.getpid(),
        fleet=service.settings.fleet,
        grpc_port=service.grpc_port,
        broker_address=address,
        broker=broker_link(link),
        broker_detail="" if link.connected else link.last_error,
        down_since=None if link.connected else link.down_since,
        **_store_fields(service),
    )


def _store_fields(service: ManagerService) -> dict[str, Any]:
    health = service.store_health()
    return {
        "store": health.state,
        "store_detail": health.detail,
        "store_free_bytes": health.free_bytes,
        "held": health.held,
        "store_since": health.since,
    }


@app.command()
@friendly_errors
def up(
    home: HomeOption = DEFAULT_HOME,
    with_superlink: Annotated[
        bool, typer.Option("--superlink", help="Also run the SuperLink (fleet jobs).")
    ] = False,
    timeout: Annotated[float, typer.Option(help="Seconds each process may take to start.")] = 30.0,
) -> None:
    """Start the broker, then `manager serve` (and the SuperLink) in the background.

    Output goes to <home>/logs/<role>.log; pid and lock files are in <home>/run/. A role
    already running is left as it is.

    Example: fedge manager up --home ./fedge-home
    """
    root = home.absolute()
    settings = ManagerHome(root).settings()
    roles = [Role.BROKER, Role.SERVE] + ([Role.SUPERLINK] if with_superlink else [])
    for role in roles:
        pid, started = launcher.start(
            root,
            role,
            launcher.fedge_command(),
            broker_port=settings.broker_port,
            timeout_s=timeout,
        )
        verb = "started" if started else "already running"
        console.print(f"{role.value:<10} {verb} (pid {pid}); log {log_path(root, role)}")
    _print_broker_link(root)


@app.command()
@friendly_errors
def down(home: HomeOption = DEFAULT_HOME) -> None:
    """Stop what `manager up` started: the SuperLink, serve, then the broker.

    Example: fedge manager down --home ./fedge-home
    """
    root = home.absolute()
    for role in reversed(launcher.UP_ORDER):
        pid = launcher.stop(root, role)
        console.print(
            f"{role.value:<10} " + ("not running" if pid is None else f"stopped (pid {pid})")
        )


@app.command()
@friendly_errors
def status(
    home: HomeOption = DEFAULT_HOME,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Which manager processes run, where their logs are, whether serve reaches the broker.

    A process started by hand (not by `manager up`) writes its output to its terminal.

    Example: fedge manager status --home ./fedge-home
    """
    root = home.absolute()
    roles = launcher.status(root)
    state = launcher.serve_state(root)
    if as_json:
        print_json(
            {
                "processes": {
                    r.role.value: {
                        "pid": r.pid,
                        "running": r.pid is not None,
                        "output": r.output.value,  # log | terminal | none
                        "logs": [str(p) for p in r.logs],  # only files that exist
                    }
                    for r in roles
                },
                "broker_link": None if state is None else state.broker.value,
                "broker_detail": None if state is None else state.broker_detail,
                "store": None if state is None else state.store,
                "store_detail": None if state is None else state.store_detail,
                "store_free_bytes": None if state is None else state.store_free_bytes,
                "held": None if state is None else state.held,
            }
        )
        return
    for r in roles:
        console.print(escape(f"{r.role.value:<10} {launcher.describe(r)}"), highlight=False)
    _print_broker_link(root)
    _print_store(root)


def _print_store(root: Path) -> None:
    """The store as serve sees it (issue 33): ok, low on space, or unwritable and how
    many messages wait for it."""
    state = launcher.serve_state(root)
    if state is None:
        return
    free = "" if state.store_free_bytes is None else f", {state.store_free_bytes} bytes free"
    if state.store == "unwritable":
        console.print(
            f"store: [red]unwritable[/red] ({escape(state.store_detail)}{free}); "
            f"{state.held} message(s) held, stored once it is writable",
            highlight=False,
        )
    elif state.store == "low":
        console.print(f"store: [yellow]low on space[/yellow]: {escape(state.store_detail)}")
    else:
        console.print(f"store: ok{free}", highlight=False)


def _print_broker_link(root: Path) -> None:
    state = launcher.serve_state(root)
    if state is None:
        console.print("serve -> broker: unknown (serve is not running)")
    elif state.broker is BrokerLink.CONNECTED:
        console.print(f"serve -> broker {state.broker_address}: connected")
    else:
        console.print(
            f"serve -> broker {state.broker_address}: [yellow]{state.broker.value}[/yellow]"
            f"{escape(_why(state))}",
            highlight=False,
        )


@app.command()
@friendly_errors
def superlink(home: HomeOption = DEFAULT_HOME) -> None:
    """Run the fleet's Flower SuperLink (stations' SuperNodes and fleet jobs meet here).

    Example: fedge manager superlink --home ./fedge-home
    """
    from fedge.edge_manager.security.superlink_access import KeySync, fleet_superlink

    manager_home = ManagerHome(home)
    settings = manager_home.settings()
    lock_fd = hold(home, Role.SUPERLINK)
    link = fleet_superlink(manager_home)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    link.start()
    # Stations' SuperNode keys follow their certificates (enrolled, renewed, revoked).
    keys = KeySync(manager_home, link) if link.node_auth else None
    if keys is not None:
        keys.start()
    security = "HTTPS, SuperNode keys from certificates" if link.tls else "plain HTTP"
    console.print(
        f"SuperLink listening on port {settings.superlink_port} for stations (Fleet API only; "
        f"apps reach them with the fleet's signature), {security}; jobs and keys on "
        f"{link.local_address}, this host only (log {link.log_path})"
    )
    while not stop.wait(0.5):
        if not link.running:
            raise ManagerError(f"the SuperLink exited; see {link.log_path}")
    if keys is not None:
        keys.stop()
    link.stop()
    os.close(lock_fd)


@app.command()
@friendly_errors
def doctor(
    home: HomeOption = DEFAULT_HOME,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Check the home's security: expiring certificates, readable keys, plain listeners.

    Exit code 1 when any finding is an error. Changes nothing.

    Example: fedge manager doctor --home ./fedge-home
    """
    from dataclasses import asdict

    from fedge.cli.common import fitted_table
    from fedge.edge_manager.doctor.facts import gather
    from fedge.edge_manager.doctor.report import counts, diagnose

    findings = diagnose(gather(ManagerHome(home)))
    tally = counts(findings)
    if as_json:
        print_json({"findings": [asdict(f) for f in findings], "counts": tally})
    else:
        table = fitted_table("severity", "check", "subject", "message", whole=("severity",))
        colour = {"error": "red", "warning": "yellow", "ok": "green"}
        for f in findings:
            severity = f"[{colour[f.severity]}]{f.severity}[/{colour[f.severity]}]"
            table.add_row(severity, f.check, escape(f.subject), escape(f.message))
        console.print(table)
        console.print(f"{tally['error']} error(s), {tally['warning']} warning(s)")
    if tally["error"]:
        raise typer.Exit(1)


app.command("watch")(operator.watch)
app.command("rotate-key")(keys.rotate_key)
app.command("keys")(keys.keys)
app.add_typer(keys.root_key_app, name="root-key")
app.command("prune")(retention.prune)

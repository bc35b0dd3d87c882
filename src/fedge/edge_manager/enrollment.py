"""Enrolling an edge: its broker account, its gRPC token, and the agent.toml it runs with."""

from pathlib import Path

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import Fleet
from fedge.edge_manager.home import ManagerHome
from fedge.transport.broker import FleetAccess, MosquittoBroker


def fleet_access(home: ManagerHome) -> FleetAccess:
    settings = home.settings()
    return FleetAccess(
        fleet=settings.fleet,
        manager_user=settings.manager_user,
        manager_password=home.manager_password(),
        edge_passwords=home.edge_passwords(),
        operator_passwords={
            name: str(account["password"]) for name, account in home.operator_accounts().items()
        },
    )


def managed_broker(home: ManagerHome) -> MosquittoBroker:
    """The Mosquitto this home runs (``fedge manager broker``), on the configured port."""
    return MosquittoBroker(home.root / "broker", fleet_access(home), home.settings().broker_port)


def agent_toml(home: ManagerHome, edge: str, password: str, data_dir: Path) -> str:
    """The agent's config, with the addresses agents reach the manager at (advertised)."""
    settings = home.settings()
    public_key = home.public_key_path.read_text().strip()
    return "\n".join(
        [
            f'fleet = "{settings.fleet}"',
            f'edge = "{edge}"',
            f'data_dir = "{data_dir}"',
            f'broker_host = "{settings.agent_broker_host}"',
            f"broker_port = {settings.broker_port}",
            f'password = "{password}"',
            f'grpc_target = "{settings.agent_grpc_target}"',
            f'superlink = "{settings.agent_superlink}"',
            f'manager_public_key = "{public_key}"',
            f'watch_dir = "{data_dir / "inbox"}"',
            "http_port = 0",
            "",
        ]
    )


def enroll(home: ManagerHome, fleet: Fleet, edge: str, data_dir: Path) -> str:
    """Register ``edge`` and return its agent.toml (which holds its secret: write it 0600)."""
    settings = home.settings()
    # An agent given a wildcard (0.0.0.0) could never connect: refused before any secret.
    problem = settings.agent_address_problem()
    if problem is not None:
        raise ManagerError(f"cannot enrol {edge}: {problem}")
    # Broker users share one namespace (the username is the client id).
    if edge == settings.manager_user:
        raise ManagerError(f"{edge!r} is the manager's own broker user; pick another edge id")
    if edge in home.operator_accounts():
        raise ManagerError(f"{edge!r} is an operator's name; pick another edge id")
    password = home.add_edge_password(edge)
    fleet.enroll(edge, password)
    broker = managed_broker(home)
    if broker.workdir.exists():
        broker.reload_running()
    return agent_toml(home, edge, password, data_dir)

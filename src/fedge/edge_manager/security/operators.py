"""Operator accounts: people and tools that watch the fleet under their own broker identity.

Before these existed, tools that talked to the broker used the manager's account. The
broker takes the username as the client id, so such a tool took over the manager's
session, and its clean start threw away the manager's queued messages (issue 9, defect 5:
one telemetry batch lost per edge). An operator account is a broker user of its own whose
ACL reads the fleet's topics and writes none (broker.FleetAccess): documents edges act on
come only from the manager, which signs them.

The plain passwords live in ``<home>/secrets/operators.json`` (0600) because the broker's
password file is regenerated from them, like the edges'. An operator receives its
credential once, as a small TOML file (:meth:`OperatorCredential.toml`).
"""

import secrets
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security import credentials
from fedge.edge_manager.security.enrollment import managed_broker, revoke
from fedge.edge_manager.store import Store
from fedge.protocols import pki, validate
from fedge.protocols.errors import ProtocolError
from fedge.protocols.pki import Role, TlsFiles
from fedge.transport.session import MqttSettings


@dataclass(frozen=True)
class Operator:
    name: str
    created_at: float


@dataclass(frozen=True)
class OperatorCredential:
    """What an operator's tool needs to connect: the broker, the fleet, an identity of its
    own -- a certificate with role "operator" (issue 13: it can never pass for the
    manager's), or in an --insecure home a password."""

    fleet: str
    name: str
    password: str = field(repr=False)
    broker_host: str
    broker_port: int
    tls: TlsFiles | None = None

    def toml(self) -> str:
        credential = (
            [f'password = "{self.password}"']
            if self.tls is None
            else [
                f'ca_file = "{self.tls.ca}"',
                f'cert_file = "{self.tls.cert}"',
                f'key_file = "{self.tls.key}"',
            ]
        )
        return "\n".join(
            [
                "# fedge operator credential: read-only access to the fleet's topics. Keep 0600.",
                f'fleet = "{self.fleet}"',
                f'operator = "{self.name}"',
                *credential,
                f'broker_host = "{self.broker_host}"',
                f"broker_port = {self.broker_port}",
                "",
            ]
        )

    def mqtt(self) -> MqttSettings:
        return MqttSettings(
            host=self.broker_host,
            port=self.broker_port,
            client_id=self.name,
            username=self.name if self.tls is None else None,
            password=self.password if self.tls is None else None,
            tls=self.tls,
            clean_start=True,
            session_expiry_s=0,
        )


def load_credential(path: Path) -> OperatorCredential:
    try:
        data = tomllib.loads(path.read_text())
        tls = None
        if "cert_file" in data:
            tls = TlsFiles(
                ca=path.parent / str(data["ca_file"]),
                cert=path.parent / str(data["cert_file"]),
                key=path.parent / str(data["key_file"]),
            )
        return OperatorCredential(
            fleet=str(data["fleet"]),
            name=str(data["operator"]),
            password="" if tls is not None else str(data["password"]),
            broker_host=str(data["broker_host"]),
            broker_port=int(data["broker_port"]),
            tls=tls,
        )
    except OSError as exc:
        raise ManagerError(f"cannot read operator credential {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, KeyError, ValueError, TypeError) as exc:
        raise ManagerError(
            f"{path} is not an operator credential ({type(exc).__name__}: {exc}); "
            "write one with `fedge manager operator add`"
        ) from None


def _check_new_name(home: ManagerHome, name: str) -> None:
    try:
        validate.identifier(name, "operator name")
    except ProtocolError as exc:
        raise ManagerError(str(exc)) from None
    if name == home.settings().manager_user:
        raise ManagerError(f"{name!r} is the manager's own broker user; pick another name")
    held = {c.role for c in _certificates(home, name) if not c.revoked}
    if name in home.edge_passwords() or "edge" in held:
        raise ManagerError(f"{name!r} is an enrolled edge; operators need names of their own")
    if name in home.operator_accounts():
        raise ManagerError(f"operator {name!r} exists; remove it first to issue a new credential")
    if held:
        raise ManagerError(f"{name!r} holds certificates already; pick another name")


def _certificates(home: ManagerHome, identity: str) -> list[credentials.IssuedCert]:
    store = Store(home.db_path)
    try:
        return credentials.certificates(store, identity)
    finally:
        store.close()


def add_operator(home: ManagerHome, name: str) -> OperatorCredential:
    """Create ``name``'s identity (a certificate, or in an --insecure home a broker
    password), let a running broker know, and return its credential."""
    _check_new_name(home, name)
    accounts = home.operator_accounts()
    password = "" if not home.settings().insecure else secrets.token_urlsafe(18)
    tls = None
    if not home.settings().insecure:
        cert, key = home.pki().ca().issue_client(name, Role.OPERATOR)
        tls = home.pki().write_client(name, cert, key)
        store = Store(home.db_path)
        try:
            info = pki.cert_info(pki.load_certificate(cert))
            credentials.record_certificate(store, info, pem=cert)
        finally:
            store.close()
    accounts[name] = {"password": password, "created_at": time.time()}
    home.save_operator_accounts(accounts)
    _reload_broker(home)
    settings = home.settings()
    # The file may be used on another machine: the advertised host, as agents get.
    return OperatorCredential(
        settings.fleet, name, password, settings.agent_broker_host, settings.broker_port, tls
    )


def remove_operator(home: ManagerHome, name: str) -> None:
    accounts = home.operator_accounts()
    if name not in accounts:
        known = ", ".join(sorted(accounts)) or "none"
        raise ManagerError(f"no operator {name!r} (operators: {known})")
    del accounts[name]
    home.save_operator_accounts(accounts)
    if not home.settings().insecure and _certificates(home, name):
        revoke(home, name)  # rewrites the CRL and reloads the broker
        return
    _reload_broker(home)


def list_operators(home: ManagerHome) -> list[Operator]:
    return [
        Operator(name, float(account["created_at"]))
        for name, account in sorted(home.operator_accounts().items())
    ]


def operator_credential(home: ManagerHome, name: str) -> OperatorCredential:
    """The credential of an existing operator, for tools run on the manager's host."""
    account = home.operator_accounts().get(name)
    if account is None:
        raise ManagerError(f"no operator {name!r}; add one with `fedge manager operator add`")
    settings = home.settings()
    tls = None if settings.insecure else home.pki().client_files(name)
    return OperatorCredential(
        settings.fleet,
        name,
        str(account["password"]),
        settings.local_broker_host,
        settings.broker_port,
        tls,
    )


def _reload_broker(home: ManagerHome) -> None:
    broker = managed_broker(home)
    if broker.workdir.exists():
        broker.reload_running()

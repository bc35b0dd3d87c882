"""The manager's home directory: where its store, keys, artifacts and secrets live.

<home>/manager.toml          fleet id, broker and gRPC addresses, advertised host (no secrets)
<home>/manager.db            SQLite store (WAL)
<home>/keys/manager.key      Ed25519 private key, 0600   (+ manager.pub)
<home>/pki/                  the fleet CA, server and manager certificates, CRL (fleet_pki.py)
<home>/secrets/              --insecure homes: broker, edge and operator passwords, 0600
<home>/artifacts/<name>/<version>/model.onnx
<home>/broker/data/mosquitto.db   the broker's save file (``broker_persistence`` moves it)
"""

import dataclasses
import ipaddress
import json
import math
import os
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.security.pki import FleetPki
from fedge.protocols import validate
from fedge.protocols.signing import SigningKey

ADVERTISE_FIX = (
    "set it with `fedge manager advertise HOST` (`--advertise-host` at `fedge manager init`)"
)


@dataclass(frozen=True)
class ManagerSettings:
    fleet: str
    broker_host: str = "127.0.0.1"
    broker_port: int = 1883
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50551
    manager_user: str = "fedge-manager"
    # The fleet's Flower SuperLink (`fedge manager superlink`): stations' SuperNodes connect
    # to its front on this port, which passes on only the Fleet API; the SuperLink itself
    # (its Control API: jobs, SuperNode keys) listens on loopback only (issue 24).
    superlink_host: str = "127.0.0.1"
    superlink_port: int = 9092
    # Retention (issue 9, defect 8), in days of a record's own time; `inf` keeps forever.
    # Predictions and telemetry are operational history that grows with every part
    # scored. Labels are training ground truth: a person's judgement, few and costly to
    # get again, so they are kept until an operator decides otherwise.
    keep_predictions_days: float = 30.0
    keep_telemetry_days: float = 30.0
    keep_labels_days: float = math.inf
    # The stored (edge, stream, seq) keys; a pruned batch redelivered is still recognised
    # (see retention.py), so they need not outlive the records.
    keep_batches_days: float = 30.0
    # Deploy events, rejected messages and desired documents older than the published one.
    keep_history_days: float = 90.0
    # The gate's evaluation items, by count: each model's newest evaluations (and every
    # item of a model an edge serves: its MPP fit reads them), issue 32.
    keep_gates_per_model: int = 5
    # The host agents reach the broker, gRPC and the SuperLink at (issue 15), written into
    # enrolled agents' configs and deployments instead of the bind hosts above, which may
    # be a wildcard (0.0.0.0) no agent can connect to. Empty: the bind hosts are reachable
    # as they are (one machine). A manager.toml from before it lacks it: empty.
    advertise_host: str = ""
    # The monitor (monitor.py, issue "The closed loop"): how often serve checks every
    # edge's serving model; the window of predictions drift and estimates are judged on;
    # the label-free (MPP) accuracy under which an alert is raised.
    monitor_interval_s: float = 10.0
    monitor_min_window: int = 100
    min_estimated_accuracy: float = 0.8
    # Plain listeners with passwords (development only, `fedge manager init --insecure`).
    # Otherwise every listener is mutual TLS with the fleet CA's certificates (issue 13).
    insecure: bool = False
    # The enrollment endpoint (`manager serve`): HTTPS with the fleet CA's server
    # certificate; a device presents a one-time token and a CSR and gets its certificate.
    enroll_port: int = 8444
    # Headroom on the store's file system (issue 33, home/space.py): under this share of
    # it or this many MiB free, whichever is more room, serve warns and prunes early.
    low_space_percent: float = 5.0
    low_space_mib: float = 500.0
    # The directory of the broker's save file (mosquitto.db: queued messages, sessions,
    # retained documents). Empty: <home>/broker/data, beside the store and so on the same
    # disk; an absolute path on another file system keeps the broker's state safe when
    # the store's disk fills (issue 33).
    broker_persistence: str = ""
    # Prometheus metrics, /healthz and /readyz of `manager serve` (issue 27): loopback by
    # default (metrics name stations, models and certificates); another address is served
    # over TLS with the fleet's certificates, a client certificate required. 0: off.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9470
    # An edge stored online and silent this long is marked lost (fleet/liveness.py;
    # agents send a heartbeat every 2.5 s). 0: only last wills and goodbyes mark it.
    edge_lost_after_s: float = 7.0

    def __post_init__(self) -> None:
        for name in RETENTION_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ManagerError(
                    f"{name} must be a number of days > 0 (inf keeps forever), got {value!r}"
                )
        if self.advertise_host and is_wildcard(self.advertise_host):
            raise ManagerError(
                f"advertise_host {self.advertise_host!r} is a wildcard: give the address "
                "agents reach this manager at, e.g. its host name or LAN address"
            )
        if not all(c.isalnum() or c in ".-:_" for c in self.advertise_host):
            raise ManagerError(f"advertise_host {self.advertise_host!r} is not a host name")
        if (
            isinstance(self.keep_gates_per_model, bool)
            or not isinstance(self.keep_gates_per_model, int)
            or self.keep_gates_per_model < 1
        ):
            raise ManagerError(
                f"keep_gates_per_model must be a whole number >= 1, got "
                f"{self.keep_gates_per_model!r}"
            )
        _check_monitor_settings(self)
        _check_space_settings(self)
        _check_ops_settings(self)

    @property
    def enroll_url(self) -> str:
        """Where devices enrol (`fedge agent enroll --manager`), as agents reach it."""
        return "https://" + _host_port(self.advertise_host or self.grpc_host, self.enroll_port)

    def server_hosts(self) -> list[str]:
        """The names this manager's servers are reached at (their certificates' SANs)."""
        return [
            self.advertise_host,
            self.broker_host,
            self.grpc_host,
            self.superlink_host,
        ]

    @property
    def local_broker_host(self) -> str:
        """Where processes on this machine reach the broker (a wildcard bind is not a name
        a certificate can carry)."""
        return "127.0.0.1" if is_wildcard(self.broker_host) else self.broker_host

    @property
    def grpc_target(self) -> str:
        return f"{self.grpc_host}:{self.grpc_port}"

    @property
    def superlink_address(self) -> str:
        """Where SuperNodes on this machine reach the SuperLink's front (a wildcard bind is
        reached on loopback, which its certificate names). Jobs are submitted elsewhere:
        :func:`fedge.aggregator.superlink.link.control_address`."""
        host = "127.0.0.1" if is_wildcard(self.superlink_host) else self.superlink_host
        return _host_port(host, self.superlink_port)

    # -- what agents are given (the advertised host, or else the bind host)

    @property
    def agent_broker_host(self) -> str:
        return self.advertise_host or self.broker_host

    @property
    def agent_grpc_target(self) -> str:
        return _host_port(self.advertise_host or self.grpc_host, self.grpc_port)

    @property
    def agent_superlink(self) -> str:
        return _host_port(self.advertise_host or self.superlink_host, self.superlink_port)

    def agent_address_problem(self, fix: str = ADVERTISE_FIX) -> str | None:
        """Why agents cannot be given these addresses (a wildcard), naming ``fix``; or None."""
        wildcards = [
            f"{name} {host!r}"
            for name, host in (
                ("broker_host", self.broker_host),
                ("grpc_host", self.grpc_host),
                ("superlink_host", self.superlink_host),
            )
            if is_wildcard(self.advertise_host or host)
        ]
        if not wildcards:
            return None
        return (
            f"{', '.join(wildcards)}: a wildcard only says where to listen, and agents need "
            f"the address they reach this manager at; {fix}"
        )


def _check_monitor_settings(settings: ManagerSettings) -> None:
    interval, window = settings.monitor_interval_s, settings.monitor_min_window
    accuracy = settings.min_estimated_accuracy
    if (
        isinstance(interval, bool)
        or not isinstance(interval, int | float)
        or not (0 < interval < math.inf)
    ):
        raise ManagerError(f"monitor_interval_s must be a number of seconds > 0, got {interval!r}")
    if isinstance(window, bool) or not isinstance(window, int) or not 10 <= window <= 100_000:
        raise ManagerError(f"monitor_min_window must be an integer in 10..100000, got {window!r}")
    if (
        isinstance(accuracy, bool)
        or not isinstance(accuracy, int | float)
        or not (0.0 <= accuracy <= 1.0)
    ):
        raise ManagerError(f"min_estimated_accuracy must be in [0, 1], got {accuracy!r}")


def _check_space_settings(settings: ManagerSettings) -> None:
    for name, high in (("low_space_percent", 100.0), ("low_space_mib", math.inf)):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < high:
            raise ManagerError(f"{name} must be a number >= 0 (and < {high:g}), got {value!r}")
    where = settings.broker_persistence
    if not isinstance(where, str) or (where and not Path(where).is_absolute()):
        raise ManagerError(
            f"broker_persistence must be an absolute directory (or empty: in the home), "
            f"got {where!r}"
        )


def _check_ops_settings(settings: ManagerSettings) -> None:
    port, lost_after = settings.metrics_port, settings.edge_lost_after_s
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ManagerError(f"metrics_port must be a port in 0..65535 (0: off), got {port!r}")
    if not isinstance(settings.metrics_host, str) or not settings.metrics_host:
        raise ManagerError(f"metrics_host must be an address, got {settings.metrics_host!r}")
    if (
        isinstance(lost_after, bool)
        or not isinstance(lost_after, int | float)
        or not (lost_after == 0 or 3.0 <= lost_after < math.inf)
    ):
        raise ManagerError(
            f"edge_lost_after_s must be 0 (off) or seconds >= 3 (agents beat every 2.5 s), "
            f"got {lost_after!r}"
        )


def is_wildcard(host: str) -> bool:
    """An address that means "every interface" to a server and nothing to a client."""
    bare = host.strip().strip("[]")
    if bare in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        return False


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


RETENTION_FIELDS = (
    "keep_predictions_days",
    "keep_telemetry_days",
    "keep_labels_days",
    "keep_batches_days",
    "keep_history_days",
)


def _write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


class ManagerHome:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def settings_path(self) -> Path:
        return self.root / "manager.toml"

    @property
    def db_path(self) -> Path:
        return self.root / "manager.db"

    @property
    def key_path(self) -> Path:
        return self.root / "keys" / "manager.key"

    @property
    def public_key_path(self) -> Path:
        return self.root / "keys" / "manager.pub"

    @property
    def broker_persistence_dir(self) -> Path:
        """Where the broker keeps its save file (``broker_persistence``, or the home's)."""
        chosen = self.settings().broker_persistence
        return Path(chosen) if chosen else self.root / "broker" / "data"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def secrets_dir(self) -> Path:
        return self.root / "secrets"

    def exists(self) -> bool:
        return self.settings_path.exists()

    def init(self, settings: ManagerSettings) -> None:
        validate.identifier(settings.fleet, "fleet")
        if self.exists():
            raise ManagerError(f"{self.root} is already a manager home; use it or pick another")
        self.root.mkdir(parents=True, exist_ok=True)
        self.save_settings(settings)
        SigningKey.generate().save(self.key_path)
        if settings.insecure:  # passwords only where there is no PKI
            _write_secret(self.secrets_dir / "manager.password", secrets.token_urlsafe(24))
            _write_secret(self.secrets_dir / "edges.json", "{}")
        else:
            self.pki().create(settings.fleet, settings.server_hosts(), settings.manager_user)

    def pki(self) -> FleetPki:
        return FleetPki(self.root / "pki")

    def save_settings(self, settings: ManagerSettings) -> None:
        self.settings_path.write_text(
            "\n".join(
                [
                    f'fleet = "{settings.fleet}"',
                    f'broker_host = "{settings.broker_host}"',
                    f"broker_port = {settings.broker_port}",
                    f'grpc_host = "{settings.grpc_host}"',
                    f"grpc_port = {settings.grpc_port}",
                    f'manager_user = "{settings.manager_user}"',
                    f'superlink_host = "{settings.superlink_host}"',
                    f"superlink_port = {settings.superlink_port}",
                    f'advertise_host = "{settings.advertise_host}"',
                    f"monitor_interval_s = {float(settings.monitor_interval_s)}",
                    f"monitor_min_window = {settings.monitor_min_window}",
                    f"min_estimated_accuracy = {float(settings.min_estimated_accuracy)}",
                    f"insecure = {'true' if settings.insecure else 'false'}",
                    f"enroll_port = {settings.enroll_port}",
                    f"low_space_percent = {float(settings.low_space_percent)}",
                    f"low_space_mib = {float(settings.low_space_mib)}",
                    f"broker_persistence = {json.dumps(settings.broker_persistence)}",
                    f"metrics_host = {json.dumps(settings.metrics_host)}",
                    f"metrics_port = {settings.metrics_port}",
                    f"edge_lost_after_s = {float(settings.edge_lost_after_s)}",
                    # float() so `inf` is written as TOML's inf
                    *(f"{name} = {float(getattr(settings, name))}" for name in RETENTION_FIELDS),
                    f"keep_gates_per_model = {settings.keep_gates_per_model}",
                    "",
                ]
            )
        )

    def settings(self) -> ManagerSettings:
        if not self.exists():
            raise ManagerError(
                f"{self.root} is not a manager home; create one with `fedge manager init`"
            )
        data = tomllib.loads(self.settings_path.read_text())
        try:
            return ManagerSettings(**data)
        except (TypeError, ManagerError) as exc:
            raise ManagerError(f"{self.settings_path}: {exc}") from None

    def advertise(self, host: str) -> ManagerSettings:
        """Set the host agents are given (``advertise_host``); agents enrolled before keep
        the address in their agent.toml until enrolled again."""
        settings = dataclasses.replace(self.settings(), advertise_host=host)
        self.save_settings(settings)
        if not settings.insecure:  # the servers' certificates must name the new host
            fleet_pki = self.pki()
            fleet_pki.issue_servers(fleet_pki.ca(), settings.server_hosts())
        return settings

    def signing_key(self) -> SigningKey:
        return SigningKey.load(self.key_path)

    def manager_password(self) -> str:
        return (self.secrets_dir / "manager.password").read_text().strip()

    def edge_passwords(self) -> dict[str, str]:
        path = self.secrets_dir / "edges.json"
        if not path.exists():
            return {}  # a TLS home: edges are certificates
        data: dict[str, str] = json.loads(path.read_text())
        return data

    def add_edge_password(self, edge: str) -> str:
        """Create (or return) the edge's broker password, which is also its gRPC token."""
        passwords = self.edge_passwords()
        if edge not in passwords:
            passwords[edge] = secrets.token_urlsafe(18)
            _write_secret(self.secrets_dir / "edges.json", json.dumps(passwords, indent=1))
        return passwords[edge]

    @property
    def operators_path(self) -> Path:
        return self.secrets_dir / "operators.json"

    def operator_accounts(self) -> dict[str, dict[str, Any]]:
        """Operator name -> {"password", "created_at"} (see operators.py)."""
        if not self.operators_path.exists():
            return {}  # a home made before operator accounts existed
        data: dict[str, dict[str, Any]] = json.loads(self.operators_path.read_text())
        return data

    def save_operator_accounts(self, accounts: dict[str, dict[str, Any]]) -> None:
        _write_secret(self.operators_path, json.dumps(accounts, indent=1))

"""The manager's long-running processes in its home: one of each, where they log, how serve is.

    <home>/run/<role>.pid   the role's lock, naming its pid (held while it runs; fedge.pidlock)
    <home>/run/serve.json   what ``manager serve`` knows of its broker connection, kept current
    <home>/run/<role>.up    the pid ``fedge manager up`` last started the role as
    <home>/logs/<role>.log  the output of a process ``fedge manager up`` started
    <home>/broker/mosquitto.log, mosquitto.stderr   Mosquitto's own log, however started
    <home>/superlink/superlink.log                  flower-superlink's, however started

A role started by hand (``fedge manager serve &``) writes its output to its terminal,
not to ``logs/``: ``fedge manager status`` tells the two apart by ``run/<role>.up``.

One ``manager serve`` (or broker) per home (issue 15: a second serve on the same home
kept knocking the first off the broker, both logging in as the manager). Commands that
only write the store -- set-threshold, deploy, labels -- ask :func:`serve_notice` whether
anything will publish what they wrote, and say so when nothing will.
"""

import enum
import errno
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from fedge import pidlock
from fedge.edge_manager.errors import ManagerError
from fedge.transport.link import LinkState


class Role(enum.Enum):
    BROKER = "broker"
    SERVE = "serve"
    SUPERLINK = "superlink"


class AlreadyRunningError(ManagerError):
    """Another process has this role on this home."""


def pid_path(root: Path, role: Role) -> Path:
    return root / "run" / f"{role.value}.pid"


def log_path(root: Path, role: Role) -> Path:
    return root / "logs" / f"{role.value}.log"


def up_marker_path(root: Path, role: Role) -> Path:
    return root / "run" / f"{role.value}.up"


def engine_log_paths(root: Path, role: Role) -> tuple[Path, ...]:
    """The logs the role's engine writes itself, whoever started the role: Mosquitto's
    (``MosquittoBroker`` in ``<home>/broker``) and flower-superlink's (``SuperLink`` in
    ``<home>/superlink``); serve has none of its own."""
    if role is Role.BROKER:
        return (root / "broker" / "mosquitto.log", root / "broker" / "mosquitto.stderr")
    if role is Role.SUPERLINK:
        return (root / "superlink" / "superlink.log",)
    return ()


def write_up_marker(root: Path, role: Role, pid: int) -> None:
    """Note that ``manager up`` started ``role`` as ``pid`` (its output: ``logs/``)."""
    path = up_marker_path(root, role)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + ".tmp")  # not serve.tmp: serve.json's
    staged.write_text(f"{pid}\n")
    os.replace(staged, path)


def read_up_marker(root: Path, role: Role) -> int | None:
    try:
        return int(up_marker_path(root, role).read_text().strip())
    except (OSError, ValueError):
        return None


def state_path(root: Path) -> Path:
    return root / "run" / "serve.json"


def hold(root: Path, role: Role) -> int:
    """Take the role's lock for this process; keep the returned descriptor open while running."""
    path = pid_path(root, role)
    try:
        got = pidlock.acquire(path)
    except OSError as exc:
        raise ManagerError(f"cannot lock {path}: {exc.strerror}") from None
    if isinstance(got, pidlock.Held):
        pid = "?" if got.pid is None else str(got.pid)
        raise AlreadyRunningError(
            f"`fedge manager {role.value}` is already running on {root} (pid {pid}); "
            f"stop it first (`fedge manager down --home {root}` or `kill {pid}`)"
        )
    return got


def running(root: Path, role: Role) -> pidlock.Held | None:
    """The process that has ``role`` on this home now, or None."""
    return pidlock.holder(pid_path(root, role))


class BrokerLink(enum.Enum):
    CONNECTED = "connected"
    CONNECTING = "connecting"  # never connected yet, no attempt has failed
    UNREACHABLE = "unreachable"  # attempts failed (or the connection was lost)


@dataclass(frozen=True)
class ServeState:
    """What a running ``manager serve`` says of itself (``run/serve.json``)."""

    pid: int
    fleet: str
    grpc_port: int
    broker_address: str
    broker: BrokerLink
    broker_detail: str = ""  # why it is not connected, when it is not
    down_since: float | None = None
    # The store (issue 33): "ok", "low" (space under the headroom) or "unwritable"; the
    # store's error or the space line; free bytes on its file system; messages held in
    # memory waiting for it; since when it is so.
    store: str = "ok"
    store_detail: str = ""
    store_free_bytes: int | None = None
    held: int = 0
    store_since: float | None = None

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "broker": self.broker.value}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ServeState":
        data = json.loads(text)
        return cls(**{**data, "broker": BrokerLink(data["broker"])})


def broker_link(link: LinkState) -> BrokerLink:
    if link.connected:
        return BrokerLink.CONNECTED
    if link.failures or link.ever_connected:
        return BrokerLink.UNREACHABLE
    return BrokerLink.CONNECTING


# serve.json is padded to this size, so a full disk (issue 33) can still take it: its
# blocks are allocated once, and overwritten in place when a new file would not fit.
STATE_BYTES = 4096


def write_serve_state(root: Path, state: ServeState) -> None:
    """Replace ``run/serve.json`` atomically (readers never see half a file); on a full
    file system, overwrite it in place within its own blocks (a reader may then, for an
    instant, see a mix and read nothing: :func:`read_serve_state` returns None)."""
    path = state_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = state.to_json()
    if len(text) < STATE_BYTES:  # JSON ignores trailing white space
        text = text.ljust(STATE_BYTES - 1) + "\n"
    staged = path.with_suffix(".tmp")
    try:
        staged.write_text(text)
        os.replace(staged, path)
    except OSError as exc:
        staged.unlink(missing_ok=True)
        if exc.errno != errno.ENOSPC or not path.exists():
            raise
        with path.open("r+") as handle:
            handle.write(text)
            handle.truncate()


def read_serve_state(root: Path) -> ServeState | None:
    try:
        return ServeState.from_json(state_path(root).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def notice_for(
    root: Path, serving: pidlock.Held | None, state: ServeState | None, consequence: str
) -> str | None:
    """What an operator should be told about ``manager serve`` (None: all is well).

    ``consequence`` says what it means for the command at hand (e.g. "the change is
    stored and is published when it runs").
    """
    if serving is None:
        return (
            f"`fedge manager serve` is not running on {root}: {consequence} "
            f"(start it with `fedge manager up --home {root}`)"
        )
    if state is None or state.pid != serving.pid or state.broker is BrokerLink.CONNECTED:
        return None
    why = f" ({state.broker_detail})" if state.broker_detail else ""
    return (
        f"`fedge manager serve` (pid {state.pid}) is not connected to the broker at "
        f"{state.broker_address}{why}: {consequence}; is `fedge manager broker` running?"
    )


def serve_notice(root: Path, consequence: str) -> str | None:
    """:func:`notice_for` this home as it is now."""
    return notice_for(root, running(root, Role.SERVE), read_serve_state(root), consequence)

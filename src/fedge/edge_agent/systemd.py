"""The agent as a systemd service: the unit ``fedge agent install-service`` writes.

Rendering is a pure function of :class:`AgentService`, so the exact text is tested; the
CLI only resolves the paths (the running ``fedge`` executable, the absolute agent.toml,
the data directory it names) and writes the file.

The unit restarts the agent whatever way it ends (``Restart=always``): the agent keeps
its state on disk (outbox, active model, applied config), so a restart resumes where it
stopped. It waits for the network (``network-online.target``) because its first act is
to connect to the broker. Hardening: the file system is read-only to the agent except
its data directory (and its inbox, if that lies elsewhere); home directories are
read-only, ``/tmp`` private, and no process it starts can gain privileges.

``Type=notify`` with a watchdog (issue 27): the agent says READY=1 once it runs, and
WATCHDOG=1 every half ``WatchdogSec`` while its publisher thread lives; a hung agent is
killed and restarted by systemd. :class:`Notifier` speaks systemd's datagram protocol on
``$NOTIFY_SOCKET`` itself (sd_notify(3)), so no new dependency; the CLI reads the two
environment variables and hands them here.
"""

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedge.edge_agent.errors import AgentError
from fedge.edge_agent.settings import AgentSettings

log = logging.getLogger(__name__)

RESTART_SEC = 5
WATCHDOG_SEC = 30
STOP_TIMEOUT_S = 30
UNIT_DIR = Path("/etc/systemd/system")


@dataclass(frozen=True)
class AgentService:
    """Everything the unit's text depends on (every path absolute)."""

    edge: str
    executable: Path
    config: Path
    writable: tuple[Path, ...]
    user: str | None = None

    @property
    def unit_name(self) -> str:
        return unit_name(self.edge)


def unit_name(edge: str) -> str:
    return f"fedge-agent-{edge}.service"


def service_for(
    settings: AgentSettings, config: Path, executable: Path, user: str | None = None
) -> AgentService:
    """The service of the agent that ``config`` (already read into ``settings``) describes.

    Writable: the data directory, and the watched inbox when it is not inside it (the
    agent moves scored images to ``inbox/done``).
    """
    writable = [settings.data_dir]
    watch_dir = settings.watch_dir
    if watch_dir is not None and not watch_dir.is_relative_to(settings.data_dir):
        writable.append(watch_dir)
    return AgentService(settings.edge, executable, config, tuple(writable), user)


# What PrivateTmp=yes replaces with a directory of the service's own: whatever the config
# names under these is invisible to the agent run by the unit (issue 27, item 7).
PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))


def hidden_by_private_tmp(settings: AgentSettings, config: Path) -> list[tuple[str, Path]]:
    """The config's paths (by their agent.toml key; ``config`` itself as "config") that
    the service will not see, because PrivateTmp=yes gives it its own /tmp and /var/tmp."""
    named: list[tuple[str, Path | None]] = [
        ("config", config),
        ("data_dir", settings.data_dir),
        ("watch_dir", settings.watch_dir),
        ("ca_file", settings.ca_file),
        ("cert_file", settings.cert_file),
        ("key_file", settings.key_file),
    ]
    return [
        (key, path)
        for key, path in named
        if path is not None and any(path.absolute().is_relative_to(tmp) for tmp in PRIVATE_TMP)
    ]


def render_unit(service: AgentService) -> str:
    """The systemd unit file for ``service``."""
    for path in (service.executable, service.config, *service.writable):
        if not path.is_absolute():
            raise AgentError(f"{path} is not an absolute path; a systemd unit needs one")
    if service.user is not None and not _valid_user(service.user):
        raise AgentError(f"{service.user!r} is not a valid user name")
    exec_start = " ".join(
        _quote(str(arg), command=True)
        for arg in (service.executable, "agent", "run", "--config", service.config)
    )
    lines = [
        f"# The fedge edge agent of {service.edge}; written by `fedge agent install-service`.",
        "[Unit]",
        f"Description=fedge edge agent {service.edge}",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        # The agent pings every WATCHDOG_SEC / 2 while its publisher thread lives.
        f"WatchdogSec={WATCHDOG_SEC}",
    ]
    if service.user is not None:
        lines.append(f"User={service.user}")
    lines += [
        f"ExecStart={exec_start}",
        "Restart=always",
        f"RestartSec={RESTART_SEC}",
        # SIGTERM: the agent publishes its offline state and stops its SuperNode first.
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "Environment=PYTHONUNBUFFERED=1",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=read-only",
        "PrivateTmp=yes",
        # No PrivateDevices=: a station that scores on its GPU needs /dev/nvidia*.
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectControlGroups=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        f"ReadWritePaths={' '.join(_quote(str(path)) for path in service.writable)}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def _valid_user(name: str) -> bool:
    return (
        0 < len(name) <= 32
        and name[0] != "-"
        and all(c.isascii() and (c.isalnum() or c in "_.-") for c in name)
    )


def _quote(word: str, *, command: bool = False) -> str:
    """One word of a systemd command line or path list.

    ``%`` starts a specifier everywhere in a unit, and ``$`` a variable in a command line.
    """
    if any(c in word for c in "\n\r\0"):
        raise AgentError(f"{word!r} holds a control character; it cannot go into a unit")
    word = word.replace("%", "%%")
    if command:
        word = word.replace("$", "$$")
    if word and not any(c.isspace() or c in "\"'\\;" for c in word):
        return word
    escaped = word.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


class Notifier:
    """sd_notify(3) over ``socket_path`` ($NOTIFY_SOCKET; None: not under systemd, every
    call does nothing). ``watchdog_usec`` is $WATCHDOG_USEC (None: no watchdog)."""

    def __init__(self, socket_path: str | None, watchdog_usec: int | None = None) -> None:
        self.socket_path = socket_path
        self.watchdog_s = None if not watchdog_usec else watchdog_usec / 1e6
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def send(self, state: str) -> bool:
        """One notification; False when it could not be sent (logged, never raised)."""
        if not self.socket_path:
            return False
        address = self.socket_path
        if address.startswith("@"):  # an abstract socket
            address = "\0" + address[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(address)
                sock.sendall(state.encode())
        except OSError as exc:
            log.warning("systemd notification %r not sent to %s: %s", state, address, exc)
            return False
        return True

    def ready(self, status: str = "") -> None:
        self.send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def stopping(self) -> None:
        self._stop.set()
        self.send("STOPPING=1")

    def keep_alive(self, healthy: Callable[[], bool]) -> None:
        """Ping the watchdog every half interval while ``healthy()``; a failed check
        skips the ping, so systemd restarts an agent whose work stopped."""
        if self.watchdog_s is None or not self.socket_path:
            return
        interval = self.watchdog_s / 2

        def ping() -> None:
            while not self._stop.wait(interval):
                if healthy():
                    self.send("WATCHDOG=1")
                else:
                    log.error("watchdog not pinged: the agent's publisher thread stopped")

        self._thread = threading.Thread(target=ping, name="watchdog", daemon=True)
        self._thread.start()

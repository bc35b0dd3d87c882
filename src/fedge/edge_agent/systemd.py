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
"""

from dataclasses import dataclass
from pathlib import Path

from fedge.edge_agent.errors import AgentError
from fedge.edge_agent.settings import AgentSettings

RESTART_SEC = 5
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
        "Type=simple",
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

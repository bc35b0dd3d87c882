"""The agent's systemd unit: exact text, quoting, and ``fedge agent install-service``."""

import contextlib
import dataclasses
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedge.cli.main import app
from fedge.edge_agent.errors import AgentError
from fedge.edge_agent.settings import load_settings
from fedge.edge_agent.systemd import (
    AgentService,
    Notifier,
    render_unit,
    service_for,
    unit_name,
)
from fedge.protocols.signing import SigningKey

UNIT = """\
# The fedge edge agent of st-01; written by `fedge agent install-service`.
[Unit]
Description=fedge edge agent st-01
Wants=network-online.target
After=network-online.target

[Service]
Type=notify
NotifyAccess=main
WatchdogSec=30
User=fedge
ExecStart=/opt/fedge/bin/fedge agent run --config /etc/fedge/agent.toml
Restart=always
RestartSec=5
TimeoutStopSec=30
Environment=PYTHONUNBUFFERED=1
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
LockPersonality=yes
ReadWritePaths=/var/lib/fedge/st-01

[Install]
WantedBy=multi-user.target
"""


SERVICE = AgentService(
    edge="st-01",
    executable=Path("/opt/fedge/bin/fedge"),
    config=Path("/etc/fedge/agent.toml"),
    writable=(Path("/var/lib/fedge/st-01"),),
    user="fedge",
)


def _service(**changes: Any) -> AgentService:
    return dataclasses.replace(SERVICE, **changes)


def _agent_toml(path: Path, data_dir: str, watch_dir: str | None = None) -> Path:
    lines = [
        'fleet = "plant-a"',
        'edge = "st-01"',
        f'data_dir = "{data_dir}"',
        'broker_host = "127.0.0.1"',
        "broker_port = 1883",
        "insecure = true",
        'password = "secret"',
        'grpc_target = "127.0.0.1:50551"',
        f'manager_public_key = "{SigningKey.generate().public.to_text()}"',
    ]
    if watch_dir is not None:
        lines.append(f'watch_dir = "{watch_dir}"')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*lines, ""]))
    return path


# ---------------------------------------------------------------- render_unit (pure)


def test_unit_text_is_exact() -> None:
    assert render_unit(_service()) == UNIT


def test_without_a_user_there_is_no_user_line() -> None:
    assert render_unit(_service(user=None)) == UNIT.replace("User=fedge\n", "")


def test_unit_name_names_the_edge() -> None:
    assert unit_name("st-01") == "fedge-agent-st-01.service"
    assert _service().unit_name == "fedge-agent-st-01.service"


def test_paths_with_spaces_percent_and_dollar_are_quoted_for_systemd() -> None:
    text = render_unit(
        _service(
            executable=Path("/opt/my fedge/bin/fedge"),
            config=Path("/etc/fedge/100%/$EDGE.toml"),
            writable=(Path("/var/lib/fedge/st 01"), Path("/srv/inbox")),
        )
    )
    assert (
        'ExecStart="/opt/my fedge/bin/fedge" agent run --config /etc/fedge/100%%/$$EDGE.toml\n'
        in text
    )
    assert 'ReadWritePaths="/var/lib/fedge/st 01" /srv/inbox\n' in text


@pytest.mark.parametrize(
    "changes",
    [
        {"config": Path("agent.toml")},
        {"executable": Path("bin/fedge")},
        {"writable": (Path("data"),)},
        {"user": "fedge\nExecStartPre=/bin/sh"},
        {"config": Path("/etc/fedge/a\nb.toml")},
    ],
    ids=["relative-config", "relative-executable", "relative-data", "bad-user", "newline"],
)
def test_what_cannot_go_into_a_unit_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(AgentError):
        render_unit(_service(**changes))


def test_the_inbox_is_writable_too_when_it_lies_outside_the_data_dir(tmp_path: Path) -> None:
    inside = load_settings(
        _agent_toml(tmp_path / "a" / "agent.toml", "/var/lib/f", "/var/lib/f/in")
    )
    assert service_for(inside, Path("/c"), Path("/x/fedge")).writable == (Path("/var/lib/f"),)
    outside = load_settings(_agent_toml(tmp_path / "b" / "agent.toml", "/var/lib/f", "/srv/cam"))
    service = service_for(outside, Path("/c"), Path("/x/fedge"), "fedge")
    assert service.writable == (Path("/var/lib/f"), Path("/srv/cam"))
    assert service.user == "fedge"


# ---------------------------------------------------------------- the command


def test_install_service_prints_the_unit_with_out_dash(tmp_path: Path) -> None:
    config = _agent_toml(tmp_path / "etc" / "agent.toml", "/var/lib/fedge/st-01")
    result = CliRunner().invoke(
        app, ["agent", "install-service", "--config", str(config), "--user", "fedge", "--out", "-"]
    )
    assert result.exit_code == 0, result.output
    fedge = Path(sys.executable).parent / "fedge"
    # The config is under pytest's /tmp: a warning on stderr, the unit alone on stdout.
    assert result.stderr.startswith(f"warning: config {config} is under /tmp")
    assert result.stdout == UNIT.replace(
        "ExecStart=/opt/fedge/bin/fedge agent run --config /etc/fedge/agent.toml",
        f"ExecStart={fedge} agent run --config {config}",
    )


def test_install_service_writes_the_unit_and_says_how_to_enable_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    config = _agent_toml(tmp_path / "etc" / "agent.toml", str(data_dir))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["agent", "install-service", "--config", "etc/agent.toml", "--user", "fedge"]
    )
    assert result.exit_code == 0, result.output
    written = tmp_path / "fedge-agent-st-01.service"
    assert written.stat().st_mode & 0o777 == 0o644
    unit = written.read_text()
    assert f"--config {config}\n" in unit, "the config path is made absolute"
    assert f"ReadWritePaths={data_dir}\n" in unit
    warned = [line.split(" ")[1] for line in result.stderr.splitlines()]
    assert warned == ["config", "data_dir"]
    assert result.stdout.splitlines() == [
        f"wrote {written}",
        "then, as root:",
        f"  install -d -o fedge {data_dir}",
        f"  install -m 0644 {written} /etc/systemd/system/fedge-agent-st-01.service",
        "  systemctl daemon-reload",
        "  systemctl enable --now fedge-agent-st-01.service",
    ]
    data_dir.mkdir()
    units = tmp_path / "units"
    units.mkdir()
    again = CliRunner().invoke(
        app, ["agent", "install-service", "--config", str(config), "--out", str(units)]
    )
    assert again.exit_code == 0, again.output
    assert (units / "fedge-agent-st-01.service").read_text() == unit.replace("User=fedge\n", "")
    assert "install -d" not in again.output, "the data dir exists now"


def test_install_service_without_a_config_is_one_red_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["agent", "install-service", "--config", str(tmp_path / "missing.toml")]
    )
    assert result.exit_code == 1
    line = " ".join(result.output.split())  # rich wraps long lines at the console's width
    assert (
        line == f"error: {tmp_path / 'missing.toml'} not found; create it with `fedge edge enroll`"
    )


@pytest.mark.integration
def test_the_notifier_speaks_sd_notify_on_a_real_datagram_socket(tmp_path: Path) -> None:
    """READY=1 with a status, WATCHDOG=1 while healthy and not while not, STOPPING=1:
    the datagrams systemd reads from $NOTIFY_SOCKET (sd_notify(3))."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(path))
        listener.settimeout(5.0)
        healthy = [True]
        notifier = Notifier(str(path), watchdog_usec=200_000)
        notifier.ready("serving m:1")
        assert listener.recv(256) == b"READY=1\nSTATUS=serving m:1"
        notifier.keep_alive(lambda: healthy[0])
        assert listener.recv(256) == b"WATCHDOG=1"
        healthy[0] = False
        listener.settimeout(0.5)
        drained = []
        with contextlib.suppress(TimeoutError):
            while True:  # at most one ping already in flight
                drained.append(listener.recv(256))
        assert len(drained) <= 1
        notifier.stopping()
        listener.settimeout(5.0)
        assert listener.recv(256) == b"STOPPING=1"


def test_without_a_notify_socket_nothing_is_sent() -> None:
    notifier = Notifier(None, watchdog_usec=1_000_000)
    assert notifier.send("READY=1") is False
    notifier.keep_alive(lambda: True)  # no thread without a socket
    assert notifier._thread is None

"""``fedge agent``: run the edge agent; label and score on the device."""

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fedge.cli.common import (
    console,
    err_console,
    fitted_table,
    friendly_errors,
    print_json,
    setup_logging,
    when,
)
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.config.privacy_budget import read_floor, set_local_floor
from fedge.edge_agent.errors import AgentError
from fedge.edge_agent.identity.enroll import enroll_device
from fedge.edge_agent.inference.images import decode_image
from fedge.edge_agent.inference.local_api import add_label, bind_local_api, start_local_api
from fedge.edge_agent.inference.watcher import watch
from fedge.edge_agent.lock import lock_data_dir
from fedge.edge_agent.settings import load_settings
from fedge.edge_agent.status.read import read_status
from fedge.edge_agent.status.view import StationStatus, threshold_text
from fedge.edge_agent.systemd import (
    UNIT_DIR,
    Notifier,
    hidden_by_private_tmp,
    render_unit,
    service_for,
)
from fedge.edge_agent.viewing.server import bind_image_server
from fedge.privacy.floor import PrivacyFloor, default_floor
from fedge.privacy.settings import PrivacyError

app = typer.Typer(help="The edge agent.", no_args_is_help=True)

TOKEN_ENV = "FEDGE_ENROLL_TOKEN"
ConfigOption = Annotated[Path, typer.Option("--config", help="agent.toml")]


@app.command()
@friendly_errors
def run(
    config: ConfigOption,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    log_file: Annotated[
        Path | None,
        typer.Option(help="Log here instead of stderr, rotated (e.g. DATA_DIR/agent.log)."),
    ] = None,
    log_max_mb: Annotated[float, typer.Option(help="Rotate the log file at this size.")] = 10.0,
    log_backups: Annotated[int, typer.Option(help="Rotated log files to keep.")] = 5,
) -> None:
    """Connect, apply configs, take deployments, score images, report.

    Example: fedge agent run --config /etc/fedge/agent.toml --log-file /var/log/fedge/st-01.log
    """
    setup_logging(
        verbose,
        log_file=log_file,
        max_bytes=max(1, int(log_max_mb * 1024 * 1024)),
        backups=max(0, log_backups),
    )
    settings = load_settings(config)
    lock_fd = lock_data_dir(settings.data_dir)  # held until the process ends
    agent = EdgeAgent(settings)
    try:  # bind before anything starts: a taken port is refused with nothing running
        api = bind_local_api(agent, settings.http_port) if settings.http_port else None
        images = bind_image_server(agent)  # states its address in the births (issue 30)
    except AgentError:
        agent.store.close()
        agent.station.close()
        raise
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    agent.start()
    if api is not None:
        start_local_api(api)
    if images is not None:
        images.start()
    if settings.watch_dir is not None:
        inbox = settings.watch_dir
        threading.Thread(target=watch, args=(agent, inbox, stop), daemon=True).start()
    api_line = "off" if api is None else f"http://127.0.0.1:{api.server_address[1]}"
    console.print(
        f"agent {settings.edge} running (serving {agent.serving or 'nothing yet'}; "
        f"local API {api_line})"
    )
    notifier = _systemd_notifier()
    notifier.ready(f"serving {agent.serving or 'nothing yet'}")
    notifier.keep_alive(agent.alive)
    stop.wait()
    notifier.stopping()
    if api is not None:  # no new requests while the stores close under them
        api.shutdown()
        api.server_close()
    agent.stop()
    os.close(lock_fd)


def _systemd_notifier() -> Notifier:
    """systemd's notify socket and watchdog (Type=notify in the unit install-service
    writes); a watchdog meant for another process (WATCHDOG_PID) is not ours."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    watchdog_pid = os.environ.get("WATCHDOG_PID", "")
    ours = not watchdog_pid or watchdog_pid == str(os.getpid())
    return Notifier(os.environ.get("NOTIFY_SOCKET"), int(usec) if usec.isdigit() and ours else None)


@app.command()
@friendly_errors
def enroll(
    manager: Annotated[str, typer.Option(help="The manager's enrollment URL (host:port).")],
    edge: Annotated[str, typer.Option(help="This station's edge id.")],
    config: ConfigOption,
    data_dir: Annotated[Path | None, typer.Option(help="Agent data dir.")] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="The one-time token from `fedge edge enroll` (scripts); otherwise read from "
            f"${TOKEN_ENV} or asked for, so it is not in the process list or shell history."
        ),
    ] = None,
    no_privacy_floor: Annotated[
        bool,
        typer.Option(
            "--no-privacy-floor",
            help="Write no privacy floor: the station then accepts rounds without DP-SGD "
            "(shown in `fedge edge show`). Default: the station trains only with DP-SGD "
            "within its own floor.",
        ),
    ] = False,
) -> None:
    """Enrol this device: make its key here, get its certificate, write agent.toml.

    Example: fedge agent enroll --manager mgr.lan:8444 --edge st-01 --config agent.toml
    """
    secret = token or os.environ.get(TOKEN_ENV) or typer.prompt("token", hide_input=True)
    enrolled = enroll_device(
        manager, edge, secret, config, data_dir, privacy_floor=not no_privacy_floor
    )
    console.print(
        f"enrolled [bold]{edge}[/bold] in fleet {enrolled.response.fleet}; config in {config}, "
        f"key in {enrolled.tls.key} (0600, never sent)",
        highlight=False,
    )


@app.command("privacy-floor")
@friendly_errors
def privacy_floor(
    config: ConfigOption,
    none: Annotated[
        bool, typer.Option("--none", help="Opt out: accept rounds without DP-SGD.")
    ] = False,
    default: Annotated[
        bool, typer.Option("--default", help="The default floor for the station's keep_images.")
    ] = False,
    job_epsilon: Annotated[float | None, typer.Option(help="Most epsilon per job.")] = None,
    lifetime_epsilon: Annotated[float | None, typer.Option(help="Most over all jobs.")] = None,
    delta: Annotated[float | None, typer.Option(help="The floor's delta.")] = None,
    min_noise_multiplier: Annotated[float | None, typer.Option(help="Least DP-SGD noise.")] = None,
) -> None:
    """Show or set this station's own privacy floor (agent.toml and its ledger; local only:
    the manager can tighten it with `fedge edge set-privacy`, never loosen it).

    Example: fedge agent privacy-floor --config agent.toml
    Example: fedge agent privacy-floor --config agent.toml --job-epsilon 4 --lifetime-epsilon 8
    """
    settings = load_settings(config)
    values = {
        "job_epsilon": job_epsilon,
        "lifetime_epsilon": lifetime_epsilon,
        "delta": delta,
        "min_noise_multiplier": min_noise_multiplier,
    }
    changes = {k: v for k, v in values.items() if v is not None}
    if none and (changes or default):
        raise typer.BadParameter("--none opts out of the floor: give no floor values with it")
    if none or default or changes:
        base = settings.privacy_floor
        if default or base is None:
            base = default_floor(settings.keep_images)
        try:
            floor = None if none else PrivacyFloor.from_table({**base.to_table(), **changes})
        except PrivacyError as exc:
            raise typer.BadParameter(str(exc)) from None
        set_local_floor(config, floor)
    written, floor = read_floor(settings.data_dir)
    if not written:
        console.print("privacy floor: not written yet (the agent writes it when it starts)")
    elif floor is None:
        console.print("privacy floor: [yellow]none[/yellow] (opted out: rounds without DP-SGD)")
    else:
        console.print(
            f"privacy floor: {floor.describe()}; at most {floor.evaluations_per_job} "
            "noised evaluations per job"
        )


@app.command()
@friendly_errors
def status(
    config: ConfigOption,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """What this station serves, the thresholds it decides with, its counts, its outbox
    backlog and its last contact: from the running agent's local API, else from its
    agent.db read-only (the first line says which).

    Example: fedge agent status --config /etc/fedge/agent.toml
    """
    station = read_status(load_settings(config))
    if as_json:
        print_json(station.to_plain())
        return
    console.print(f"read from {station.source}", highlight=False, markup=False, soft_wrap=True)
    console.print(_status_table(station))


def _status_table(station: StationStatus) -> Table:
    counts = station.counts
    table = fitted_table("", "")
    table.show_header = False
    serving = station.serving or "nothing yet"
    if counts.deployment:
        serving += f" (deployment {counts.deployment})"
    if station.execution_provider:
        serving += f" on {station.execution_provider}"
    rate = station.reject_rate
    now = time.time()
    if station.broker_connected is None:
        broker = "unknown (the agent is not running)"
    else:
        broker = "connected" if station.broker_connected else "not connected"
        if station.via_grpc:
            broker += "; reporting over gRPC"
    acknowledged = counts.last_acknowledged_at
    oldest = counts.oldest_unsent_at
    rows = (
        ("edge", station.edge),
        ("serving", serving),
        ("config", f"v{station.config_version}" if station.config_version else "none applied"),
        ("thresholds", threshold_text(station.thresholds)),
        ("predictions", f"{counts.predictions} held on the station"),
        ("rejects", f"{counts.rejects}" + ("" if rate is None else f" ({rate:.1%})")),
        ("labels", str(counts.labels)),
        (
            "outbox",
            f"{counts.pending_records} record(s) to seal, {counts.outbox_batches} batch(es) "
            "unacknowledged"
            + ("" if oldest is None else f"; oldest from {when(oldest)} ({_ago(now, oldest)})"),
        ),
        ("broker", broker),
        (
            "last acknowledged",
            "never"
            if acknowledged is None
            else f"{when(acknowledged)} ({_ago(now, acknowledged)})",
        ),
    )
    for name, value in rows:
        table.add_row(name, escape(value))
    return table


def _ago(now: float, at: float) -> str:
    seconds = max(0.0, now - at)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


@app.command()
@friendly_errors
def label(
    prediction_id: str,
    label_value: Annotated[str, typer.Argument(metavar="LABEL")],
    config: ConfigOption,
    who: str = "operator",
) -> None:
    """Store an operator label on the device (kept for local training, reported up).

    Example: fedge agent label p-1f3a... scratch --config agent.toml
    """
    agent = EdgeAgent(load_settings(config))
    try:
        console.print(add_label(agent, prediction_id, label_value, who))
    finally:
        agent.store.close()


@app.command()
@friendly_errors
def score(image: Path, config: ConfigOption) -> None:
    """Score one image with the active model, offline, and record the prediction.

    Example: fedge agent score part-0042.png --config agent.toml
    """
    settings = load_settings(config)
    agent = EdgeAgent(settings)
    try:
        scored = agent.score(decode_image(image, settings.image_size), source=f"cli:{image.name}")
        print_json(
            {
                "prediction_id": scored.record.prediction_id,
                "decision": scored.record.decision,
                "scores": scored.record.scores,
            }
        )
    finally:
        agent.store.close()


@app.command("install-service")
@friendly_errors
def install_service(
    config: ConfigOption,
    user: Annotated[
        str | None,
        typer.Option(help="Run the agent as this user (it must own the data dir; default root)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Unit file or directory to write, or '-' to print the unit "
            "(default: ./fedge-agent-EDGE.service).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Write a systemd unit that runs this agent at boot and restarts it whenever it stops.

    ExecStart is this very fedge executable with `agent run --config CONFIG`; only the
    agent's data dir (and inbox) is writable. Prints the commands that enable it.

    Example: fedge agent install-service --config /etc/fedge/agent.toml --user fedge
    """
    config = config.absolute()
    settings = load_settings(config)
    service = service_for(settings, config, _fedge_executable(), user)
    unit = render_unit(service)
    for key, path in hidden_by_private_tmp(settings, config):
        err_console.print(
            f"[yellow]warning:[/yellow] {key} {path} is under /tmp or /var/tmp: the unit "
            "runs with PrivateTmp=yes, so the service sees its own empty /tmp there, not "
            "this path; move it (e.g. under /var/lib/fedge) before enabling the unit",
            highlight=False,
            soft_wrap=True,
        )
    if out == Path("-"):
        typer.echo(unit, nl=False)
        return
    target = out if out is not None else Path(service.unit_name)
    if target.is_dir():
        target = target / service.unit_name
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(unit)
        target.chmod(0o644)
    except OSError as exc:
        raise AgentError(f"cannot write {target}: {exc}; pass --out PATH or --out -") from None
    target = target.absolute()
    typer.echo(f"wrote {target}")
    typer.echo("then, as root:")
    missing = [str(path) for path in service.writable if not path.is_dir()]
    if missing:
        owner = f" -o {user}" if user else ""
        typer.echo(f"  install -d{owner} {' '.join(missing)}")
    installed = UNIT_DIR / service.unit_name
    if target != installed:
        typer.echo(f"  install -m 0644 {target} {installed}")
    typer.echo("  systemctl daemon-reload")
    typer.echo(f"  systemctl enable --now {service.unit_name}")


def _fedge_executable() -> Path:
    """The absolute path of the ``fedge`` command that is running (its venv's, if any)."""
    invoked = Path(sys.argv[0])
    if invoked.name == "fedge" and invoked.is_file():
        return invoked.absolute()
    beside = Path(sys.executable).parent / "fedge"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside.absolute()
    found = shutil.which("fedge")
    if found is None:
        raise AgentError("cannot find the fedge executable; run this as `fedge agent ...`")
    return Path(found).absolute()

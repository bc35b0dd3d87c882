"""``fedge edge``: enrol edges, push thresholds, see desired vs reported."""

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    fitted_table,
    friendly_errors,
    open_fleet,
    print_json,
    warn_if_not_serving,
    when,
    write_secret_file,
)
from fedge.console.deciding import deciding
from fedge.console.queries import config_at
from fedge.console.views import manifest_of
from fedge.edge_manager.fleet.edge_store import EdgeSummary
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.fleet.views import ThresholdsSource
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security.enrollment import enroll as enroll_edge
from fedge.edge_manager.security.enrollment import invite
from fedge.edge_manager.security.enrollment import revoke as revoke_identity
from fedge.edge_manager.security.key_rotation import EdgeTrust, edge_trust

app = typer.Typer(help="Edges: enrolment, configuration, state.", no_args_is_help=True)


def _when(ts: Any) -> str:
    return when(None if ts is None else float(ts))


# Where the serving model's thresholds come from (Fleet.show's thresholds_source).
_SOURCES: dict[ThresholdsSource, str] = {
    "config": "the desired config's",
    "model": "the serving model's recommended ones (the config is for another model)",
    "untied": "the desired config's, set for another model (the serving one recommends none)",
    "default": "the built-in default 0.5 (no config yet, no recommended ones)",
}


def _per_class(thresholds: dict[str, float]) -> str:
    """Per-class thresholds for people (``scratch 0.6``), not a dict's repr."""
    return ", ".join(f"{name} {value:g}" for name, value in sorted(thresholds.items())) or "none"


@app.command()
@friendly_errors
def enroll(
    edge: str,
    out: Annotated[
        Path | None,
        typer.Option(
            help="The device's folder is on this machine: write its agent.toml here (0600), "
            "its key and certificate beside it. Without it, print a one-time token for "
            "`fedge agent enroll` on the device."
        ),
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Agent data dir on the device.")] = None,
    ttl: Annotated[float, typer.Option(help="Seconds the token is valid.")] = 3600.0,
    no_privacy_floor: Annotated[
        bool,
        typer.Option(
            "--no-privacy-floor",
            help="With --out: write no privacy floor (the station then accepts rounds "
            "without DP-SGD; `fedge edge show` says so). With a token, the device chooses "
            "(`fedge agent enroll --no-privacy-floor`).",
        ),
    ] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Enrol an edge: a single-use token for its device, or (--out) its agent.toml here.

    Example: fedge edge enroll st-01            (prints the command to run on the device)
    Example: fedge edge enroll st-01 --out st-01/agent.toml
    """
    manager_home = ManagerHome(home)
    if out is None:
        invitation = invite(manager_home, edge, ttl_s=ttl)
        console.print(
            f"token for [bold]{edge}[/bold], single use, valid {ttl:.0f} s (it pins the "
            "fleet CA); on the device run the command and paste the token when asked:"
        )
        typer.echo(invitation.command())
        typer.echo(f"token: {invitation.token}")
        return
    manager_home, fleet = open_fleet(home)
    directory = (data_dir or out.parent.resolve() / "data").resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    text = enroll_edge(
        manager_home,
        fleet,
        edge,
        directory,
        tls_dir=out.parent.resolve(),
        privacy_floor=not no_privacy_floor,
    )
    write_secret_file(out, text)
    console.print(f"enrolled [bold]{edge}[/bold]; agent config in {out}")


@app.command()
@friendly_errors
def revoke(edge: str, home: HomeOption = DEFAULT_HOME) -> None:
    """Revoke an edge's certificates: the broker and gRPC refuse it within seconds.

    Example: fedge edge revoke st-07
    """
    revoked = revoke_identity(ManagerHome(home), edge)
    console.print(
        f"revoked {len(revoked)} certificate(s) of [bold]{edge}[/bold]; "
        "enrol it again for a new one",
        highlight=False,
    )


def _anomaly_value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise typer.BadParameter(
            f"--anomaly takes a number or 'recommended', got {text!r}"
        ) from None


# A negative VALUE (e.g. -0.1) is an argument, not an unknown option: it then gets the
# library's range error rather than click's "No such option '-0'".
@app.command("set-threshold", context_settings={"ignore_unknown_options": True})
@friendly_errors
def set_threshold(
    edge: Annotated[str, typer.Argument(help="Edge id, or 'all'.")],
    value: Annotated[float | None, typer.Argument(help="Threshold in [0, 1].")] = None,
    class_name: Annotated[str | None, typer.Option("--class", help="Only this class.")] = None,
    anomaly: Annotated[
        str | None,
        typer.Option(
            "--anomaly",
            help="Instead: the anomaly score over which a part is novel (a distance > 0), "
            "or 'recommended': the threshold the station itself reported for the anomaly "
            "model deployed beside its classifier (its held-out good parts' quantile).",
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="The model version the threshold is for, e.g. inspect:4 (default: the "
            "model deployed to the edge)."
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Even on an edge in an unfinished staged rollout.")
    ] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Push a new decision threshold to an edge (a new signed config version).

    The thresholds are tied to a model version: an edge that serves another one applies
    that model's recommended thresholds (if it was published with some).

    Example: fedge edge set-threshold st-07 0.72 --class scratch --model inspect:4
    Example: fedge edge set-threshold st-07 --anomaly 14.2
    Example: fedge edge set-threshold all --anomaly recommended
    """
    if (value is None) == (anomaly is None):
        raise typer.BadParameter("give a threshold VALUE or --anomaly VALUE (one of them)")
    _, fleet = open_fleet(home)
    edges = fleet.edges() if edge == "all" else [edge]
    if anomaly is not None:
        chosen: dict[str, tuple[float, str]] = {}
        for target in edges:  # every value is found before any is pushed
            if anomaly == "recommended":
                chosen[target] = fleet.recommended_anomaly_threshold(target)
            else:
                chosen[target] = (_anomaly_value(anomaly), "given")
        values = {target: threshold for target, (threshold, _) in chosen.items()}
        for pushed in fleet.set_anomaly_thresholds(values, force=force):
            threshold, source = chosen[pushed.edge]
            why = "" if source == "given" else f", reported by {pushed.edge} for {source}"
            console.print(
                f"{pushed.edge}: desired config v{pushed.version} "
                f"(anomaly threshold {threshold:g}{why})",
                highlight=False,
            )
        warn_if_not_serving(home, "the config is stored and is sent to the edges once it runs")
        return
    assert value is not None
    for pushed in fleet.set_threshold(edges, value, class_name, model, force=force):
        tie = f"for {pushed.model}" if pushed.model else "for any model: none is deployed"
        console.print(
            f"{pushed.edge}: desired config v{pushed.version} (threshold {value}, {escape(tie)})",
            highlight=False,
        )
    warn_if_not_serving(home, "the config is stored and is sent to the edges once it runs")


@app.command("unset-threshold")
@friendly_errors
def unset_threshold(
    edge: Annotated[str, typer.Argument(help="Edge id, or 'all'.")],
    class_name: Annotated[str, typer.Option("--class", help="The class whose threshold goes.")],
    force: Annotated[
        bool, typer.Option("--force", help="Even on an edge in an unfinished staged rollout.")
    ] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Remove a per-class threshold (a new signed config version); the default applies.

    Example: fedge edge unset-threshold st-07 --class scratch
    """
    _, fleet = open_fleet(home)
    edges = fleet.edges() if edge == "all" else [edge]
    for pushed in fleet.clear_threshold(edges, class_name, force=force):
        console.print(
            f"{pushed.edge}: desired config v{pushed.version} (no threshold for "
            f"{escape(class_name)}: the default applies)",
            highlight=False,
        )
    warn_if_not_serving(home, "the config is stored and is sent to the edges once it runs")


@app.command("set-training")
@friendly_errors
def set_training(
    edge: Annotated[str, typer.Argument(help="Edge id, or 'all'.")],
    enable: Annotated[
        bool, typer.Option("--enable/--disable", help="Train as a federated party, or stop.")
    ] = True,
    max_minutes: Annotated[
        float, typer.Option(help="Longest local training of one round, in minutes.")
    ] = 10.0,
    threads: Annotated[int, typer.Option(help="CPU threads training may use.")] = 1,
    window: Annotated[
        list[str] | None,
        typer.Option(
            "--window",
            help="When the job scheduler may place jobs here: a shift '22:00-06:00' (local "
            "time) or 'idle 30m' (the line scored nothing for 30 min); repeat for several, "
            "any one open suffices. None: any time.",
        ),
    ] = None,
    utc_offset_minutes: Annotated[
        int | None,
        typer.Option(help="The station's local time east of UTC, in minutes (shift windows)."),
    ] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Let a station train on its labelled images as a federated party (signed config).

    Example: fedge edge set-training st-01 --enable --max-minutes 10
    --window 22:00-06:00 --window 'idle 30m' --utc-offset-minutes 60
    """
    from fedge.edge_manager.scheduler.errors import SchedulerError
    from fedge.edge_manager.scheduler.windows import parse_window
    from fedge.protocols.config import TrainingPolicy
    from fedge.protocols.errors import ProtocolError

    windows = tuple(w.strip() for w in window) if window else None
    try:
        # Both checks before anything is signed: the config's own and the scheduler's
        # (which also refuses a shift that opens and closes at once).
        policy = TrainingPolicy(
            enabled=enable,
            max_minutes=max_minutes,
            threads=threads,
            windows=windows,
            utc_offset_minutes=utc_offset_minutes,
        )
        for text in windows or ():
            parse_window(text)
    except ProtocolError as exc:
        raise typer.BadParameter(str(exc)) from None
    except SchedulerError as exc:
        raise typer.BadParameter(f"training window: {exc}") from None
    _, fleet = open_fleet(home)
    edges = fleet.edges() if edge == "all" else [edge]
    state = f"enabled, {max_minutes:g} min, {threads} thread(s)" if enable else "disabled"
    if windows:
        state += f", windows {', '.join(windows)}"
        if utc_offset_minutes:
            state += f" (UTC{utc_offset_minutes:+d} min)"
    for pushed in fleet.set_training(edges, policy):
        console.print(f"{pushed.edge}: desired config v{pushed.version} (training {state})")


@app.command("set-privacy", context_settings={"ignore_unknown_options": True})
@friendly_errors
def set_privacy(
    edge: Annotated[str, typer.Argument(help="Edge id, or 'all'.")],
    epsilon: Annotated[
        float | None, typer.Option(help="Lifetime epsilon: every job's DP rounds together.")
    ] = None,
    delta: Annotated[
        float | None, typer.Option(help="The delta the epsilon is for, in (0, 1) [default: 1e-3].")
    ] = None,
    clear: Annotated[
        bool, typer.Option("--clear", help="Remove the lifetime bound (jobs' targets still hold).")
    ] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Set a station's lifetime privacy budget (a new signed config version).

    The station refuses a DP-SGD round that would take the epsilon it spent
    over all jobs past this bound (its agent keeps the bound in its ledger).

    Example: fedge edge set-privacy st-01 --epsilon 8 --delta 1e-3
    """
    if clear == (epsilon is not None):
        raise typer.BadParameter("give --epsilon (with --delta) or --clear", param_hint="--epsilon")
    if clear and delta is not None:
        raise typer.BadParameter("--clear removes the bound: give no --delta", param_hint="--delta")
    delta = 1e-3 if delta is None else delta
    _, fleet = open_fleet(home)
    edges = fleet.edges() if edge == "all" else [edge]
    state = "no lifetime bound" if clear else f"lifetime epsilon {epsilon:g} at delta {delta:g}"
    for pushed in fleet.set_privacy(edges, None if clear else epsilon, delta):
        console.print(f"{pushed.edge}: desired config v{pushed.version} ({state})")
    warn_if_not_serving(home, "the config is stored and is sent to the edges once it runs")


@app.command("set-thumbnails")
@friendly_errors
def set_thumbnails(
    edge: Annotated[str, typer.Argument(help="Edge id, or 'all'.")],
    share: Annotated[
        bool,
        typer.Option("--share/--stop", help="Share thumbnails of scored images, or stop."),
    ] = True,
    size: Annotated[int, typer.Option(help="Longest side in pixels (16-96).")] = 64,
    rejects_only: Annotated[
        bool, typer.Option("--rejects-only/--all", help="Only the images the station rejected.")
    ] = True,
    per_minute: Annotated[int, typer.Option(help="At most this many a minute.")] = 30,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Let a station share small thumbnails of what it scores with the console (a new
    signed config version). Off by default: a station's images stay on the station.

    Example: fedge edge set-thumbnails st-01 --share --size 64 --rejects-only
    """
    from fedge.protocols.errors import ProtocolError
    from fedge.protocols.thumbnails import ThumbnailPolicy

    _, fleet = open_fleet(home)
    edges = fleet.edges() if edge == "all" else [edge]
    try:
        policy = ThumbnailPolicy(size, rejects_only, per_minute) if share else None
    except ProtocolError as exc:
        raise typer.BadParameter(str(exc)) from None
    for pushed in fleet.set_thumbnails(edges, policy):
        console.print(f"{pushed.edge}: desired config v{pushed.version} (images {_images(policy)})")
    warn_if_not_serving(home, "the config is stored and is sent to the edges once it runs")


@app.command("set-viewing")
@friendly_errors
def set_viewing(
    edge: Annotated[str, typer.Argument(help="Edge id, or 'all'.")],
    allow: Annotated[
        bool,
        typer.Option("--allow/--deny", help="Let operators view its images on demand, or not."),
    ] = True,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Let operators view a station's images on demand in the console, fetched from the
    station over mutual TLS and never stored at the manager (a new signed config
    version; the station enforces it). Off by default. The manager's home is an
    admin's: in the console only an admin account may change it.

    Example: fedge edge set-viewing st-01 --allow
    """
    _, fleet = open_fleet(home)
    edges = fleet.edges() if edge == "all" else [edge]
    state = "operators may view its images" if allow else "its images stay on the station"
    for pushed in fleet.set_viewing(edges, allow):
        console.print(f"{pushed.edge}: desired config v{pushed.version} ({state})")
    warn_if_not_serving(home, "the config is stored and is sent to the edges once it runs")


def _images(policy: Any) -> str:
    """What a station's config says of its images (a ThumbnailPolicy, its dict, or None)."""
    if policy is None:
        return "stay on the station"
    plain = policy if isinstance(policy, dict) else vars(policy)
    which = "rejected ones" if plain["rejects_only"] else "all scored"
    return f"shared as thumbnails: {which}, {plain['size']} px, at most {plain['per_minute']}/min"


def _privacy(budget: dict[str, float] | None, spent: float | None) -> str:
    """The desired lifetime budget, and the epsilon the station last said it spent."""
    bound = "no lifetime bound"
    if budget is not None:
        bound = f"lifetime epsilon {budget['epsilon']:g} at delta {budget['delta']:g}"
    if spent is None:
        return f"{bound}; spent: not reported"
    return f"{bound}; spent epsilon {spent:.3g} (as the station last reported)"


def _floor(lifetime: float | None, job: float | None) -> str:
    """The station's own privacy floor, as its agent last reported it."""
    if lifetime is None:
        return "not reported"
    if lifetime == 0:
        return "[yellow]none: the station's operator opted out (rounds without DP)[/yellow]"
    per_job = "" if job is None else f"epsilon {job:g} per job, "
    return f"DP-SGD only, {per_job}lifetime epsilon {lifetime:g} (the station's own)"


@app.command()
@friendly_errors
def show(
    edge: str,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Desired vs reported config, liveness, model, counts and gaps of one edge.

    Example: fedge edge show st-01
    """
    _, fleet = open_fleet(home)
    view = fleet.show(edge)
    trust = edge_trust(fleet.store, edge)
    # On stderr: --json output stays clean. A state is only as fresh as serve's ingest.
    warn_if_not_serving(home, "the state shown is the last one reported")
    if as_json:
        print_json({**view.to_json(), "trust": None if trust is None else asdict(trust)})
        return
    desired = view.desired_config or {}
    sync = "[green]in sync[/green]" if view.in_sync else "[yellow]converging[/yellow]"
    console.print(f"[bold]{edge}[/bold]  {view.state} (session {view.session})")
    console.print(f"  last seen      {_when(view.last_seen)}")
    console.print(
        f"  config         desired v{view.desired_config_version} "
        f"(threshold {desired.get('default_threshold', '-')}, "
        f"per class {escape(_per_class(desired.get('class_thresholds', {})))}) "
        f"for {escape(view.thresholds_for or 'any model')} / reported "
        f"v{view.config_applied} {sync} {escape(view.config_reason)}"
    )
    console.print(f"  thresholds     {escape(_SOURCES[view.thresholds_source])}")
    spent = view.privacy_epsilon_spent
    console.print(f"  privacy        {_privacy(desired.get('privacy'), spent)}")
    floor = _floor(view.privacy_floor_epsilon, view.privacy_floor_job_epsilon)
    console.print(f"  privacy floor  {floor}")
    console.print(f"  images         {_images(desired.get('thumbnails'))}")
    console.print(f"  serving        {escape(view.serving or '-')}")
    deployment = f"{view.deploy_id or '-'} {view.deploy_stage} {view.deploy_reason}"
    console.print(f"  deployment     {escape(deployment)}")
    agreement = view.label_agreement
    console.print(
        f"  predictions    {view.predictions} (accept {view.accepts}, "
        f"reject {view.rejects}); labels {view.labels}; agreement "
        f"{'-' if agreement is None else f'{agreement:.0%}'}"
    )
    console.print(f"  telemetry      {view.telemetry} records; rejected msgs {view.rejections}")
    gaps = ", ".join(f"{g.stream} {g.from_seq}..{g.to_seq}" for g in view.gaps)
    console.print(f"  gaps           {gaps or 'none'}")
    console.print(f"  trust          {escape(_trust(trust))}")


def _trust(trust: EdgeTrust | None) -> str:
    """The manager key the station trusts, and a refused rotation or a stale desired
    state (a freeze attack, issue 24) in its own words."""
    if trust is None or not trust.key_id:
        return "key it was enrolled with (nothing reported)"
    text = f"key {trust.key_id} (rotation {trust.sequence}) {trust.status}"
    return f"{text}: {trust.reason}" if trust.reason else text


@app.command("list")
@friendly_errors
def list_edges(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """All edges with state, model and config versions.

    Example: fedge edge list
    """
    _, fleet = open_fleet(home)
    warn_if_not_serving(home, "the states shown are the last ones reported")
    rows = [(row, _deciding(fleet, row)) for row in fleet.list()]
    if as_json:
        print_json([{**asdict(row), "threshold": threshold} for row, threshold in rows])
        return
    table = fitted_table(
        "edge",
        "state",
        "session",
        "last seen",
        "serving",
        "config (desired/applied)",
        "threshold",
        "deploy",
    )
    for row, threshold in rows:
        table.add_row(
            row.edge,
            row.state,
            str(row.session),
            _when(row.last_seen),
            row.serving or "-",
            f"v{row.config_desired}/v{row.config_applied}",
            escape(threshold),
            escape(row.deploy_stage or "-"),
        )
    console.print(table)


def _deciding(fleet: Fleet, row: EdgeSummary) -> str:
    """The threshold that decides at ``row``'s station, as the console's fleet table
    shows it (console/deciding.py: the agent's own rule over the config it applied and
    the model it serves), each per-class threshold that overrides the default named;
    "?" when the applied config is no longer held."""
    in_force = config_at(fleet, row.edge, row.config_applied)
    if in_force is None:
        return "?"
    config = None if row.config_applied == 0 else in_force
    return deciding(config, manifest_of(fleet, row.serving)).text()

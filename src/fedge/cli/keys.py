"""``fedge manager rotate-key`` and ``fedge manager keys``: the fleet's signing key."""

import dataclasses
import datetime
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    fitted_table,
    friendly_errors,
    print_json,
)
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security.key_rotation import (
    fleet_root,
    key_since,
    make_root_key,
    pin_root,
    rotate,
    rotation_due,
    trust_view,
)
from fedge.protocols.signing import PublicKey, SigningKey

root_key_app = typer.Typer(
    help="The fleet's offline root key: it authorises every rotation of the signing key.",
    no_args_is_help=True,
)


@friendly_errors
def rotate_key(
    home: HomeOption = DEFAULT_HOME,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    if_older_than: Annotated[
        float | None,
        typer.Option(
            "--if-older-than",
            min=1.0,
            help="Rotate only when the key in use is at least this many days old (for a "
            "schedule: cron or a systemd timer running this with --yes).",
        ),
    ] = None,
    root_key: Annotated[
        Path | None,
        typer.Option(
            "--root-key",
            help="The fleet's offline root key (required when the fleet has one: "
            "keys/root.pub); read, used to sign this rotation, never copied.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Replace the manager's signing key; edges follow a rotation old and new key sign.

    The link is signed by the old key, the new key and, on a fleet with a root key, the
    offline root key. Edges trust only the new key once they have the rotation (retained
    on their down/trust topic, or over gRPC); the old private key is deleted. A running
    `manager serve` signs with the new key within a moment.

    Example: fedge manager rotate-key --home ./fedge-home --yes
    With a root key: fedge manager rotate-key --yes --root-key /media/usb/fleet-root.key
    Scheduled: fedge manager rotate-key --yes --if-older-than 90
    """
    manager = ManagerHome(home)
    now = time.time()
    if if_older_than is not None:
        since = key_since(manager)
        if not rotation_due(since, now, if_older_than):
            age = (now - since) / 86400.0
            if as_json:
                print_json({"rotated": False, "age_days": round(age, 3)})
            else:
                console.print(
                    f"signing key in use for {age:.1f} days (< {if_older_than:g}): not rotated"
                )
            return
    if not yes:
        typer.confirm(
            "Rotate the fleet's signing key? Edges follow when they next connect (the "
            "rotation is retained for them); the old private key is deleted",
            abort=True,
        )
    root = None if root_key is None else SigningKey.load(root_key)
    done = rotate(manager, now=now, root_key=root)
    if as_json:
        print_json({"rotated": True, **dataclasses.asdict(done)})
        return
    console.print(
        f"signing key {done.old_key_id} -> [bold]{done.new_key_id}[/bold] (rotation "
        f"{done.sequence}); sent to {done.edges} edge(s), {done.documents} desired "
        f"document(s) and {done.manifests} manifest(s) re-signed"
    )
    console.print("follow it with: fedge manager keys")


@friendly_errors
def keys(
    home: HomeOption = DEFAULT_HOME,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The signing key, its rotations, and which key each edge says it trusts.

    Example: fedge manager keys --home ./fedge-home
    """
    view = trust_view(ManagerHome(home))
    if as_json:
        print_json(
            {
                **dataclasses.asdict(view),
                "on_current_key": view.on_current_key(),
                "behind": view.behind(),
            }
        )
        return
    age = (time.time() - view.since) / 86400.0
    console.print(
        f"signing key [bold]{view.key_id}[/bold] (rotation {view.sequence}; "
        f"in use for {age:.1f} days)"
    )
    for sequence, signer, new, at in view.links:
        when = datetime.datetime.fromtimestamp(at).isoformat(timespec="seconds")
        console.print(f"  rotation {sequence}: {signer} -> {new} at {when}")
    table = fitted_table("edge", "trusts", "rotation", "status", "reason", whole=("edge",))
    for edge in view.edges:
        trusts = edge.key_id or "(enrolment key; no rotation seen)"
        mark = "" if edge.key_id == view.key_id else " [yellow]behind[/yellow]"
        table.add_row(
            edge.edge,
            escape(trusts) + mark,
            str(edge.sequence),
            edge.status or "-",
            escape(edge.reason),
        )
    console.print(table)
    console.print(f"{len(view.on_current_key())} of {len(view.edges)} edge(s) on the current key")


@root_key_app.command("init")
@friendly_errors
def root_key_init(
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="Where to write the root key (0600; and OUT.pub): "
            "removable media or an operator's machine, not the manager's home.",
        ),
    ],
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Make the fleet's offline root key and pin its public half in the manager's home.

    Stations enrolled from then on pin it too, and follow a key rotation only with its
    signature: a stolen signing key alone can no longer move the fleet to another key.
    Stations enrolled before do not check it (re-enroll them).

    Example: fedge manager root-key init --out /media/usb/fleet-root.key
    """
    manager = ManagerHome(home)
    manager.settings()  # an initialised home, before a key is made for it
    key = make_root_key(out)
    pin_root(manager, key.public)
    console.print(
        f"root key [bold]{key.public.key_id}[/bold] written to {escape(str(out))} (keep it "
        "offline; `rotate-key --root-key` needs it) and pinned in the home"
    )


@root_key_app.command("pin")
@friendly_errors
def root_key_pin(
    public_key: Annotated[Path, typer.Argument(help="The root key's .pub file.")],
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Pin a root key made elsewhere (`root-key init` on another machine) by its .pub.

    Example: fedge manager root-key pin /media/usb/fleet-root.pub
    """
    manager = ManagerHome(home)
    public = PublicKey.load(public_key)
    pin_root(manager, public)
    console.print(f"root key [bold]{public.key_id}[/bold] pinned")


@root_key_app.command("show")
@friendly_errors
def root_key_show(home: HomeOption = DEFAULT_HOME) -> None:
    """The fleet's root key id, if it has one.

    Example: fedge manager root-key show
    """
    root = fleet_root(ManagerHome(home))
    console.print("no root key" if root is None else f"root key {root.key_id}")

"""``fedge manager rotate-key`` and ``fedge manager keys``: the fleet's signing key."""

import dataclasses
import datetime
import time
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
from fedge.edge_manager.home import ManagerHome
from fedge.edge_manager.key_rotation import key_since, rotate, rotation_due, trust_view


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
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Replace the manager's signing key; every edge follows a rotation the old key signs.

    Edges trust only the new key once they have the rotation (retained on their
    down/trust topic, or over gRPC); the old private key is deleted. A running
    `manager serve` signs with the new key within a moment.

    Example: fedge manager rotate-key --home ./fedge-home --yes
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
    done = rotate(manager, now=now)
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

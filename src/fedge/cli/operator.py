"""``fedge manager operator`` and ``fedge manager watch``: read-only broker accounts for
people and tools, and a watcher that uses one (never the manager's own identity)."""

import datetime
import json
import signal
import threading
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    friendly_errors,
    print_json,
    write_secret_file,
)
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.watch import FleetWatcher
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security.operators import (
    OperatorCredential,
    add_operator,
    list_operators,
    load_credential,
    operator_credential,
    remove_operator,
)

app = typer.Typer(
    help="Operator accounts: read-only broker users for people and tools.", no_args_is_help=True
)


@app.command()
@friendly_errors
def add(
    name: Annotated[str, typer.Argument(help="Operator name (not an edge id, not the manager).")],
    out: Annotated[
        Path | None,
        typer.Option(help="Credential file to write (0600); '-' prints it to stdout instead."),
    ] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Create an operator's broker account and write its credential once.

    Example: fedge manager operator add alice --out alice.operator.toml
    """
    credential = add_operator(ManagerHome(home), name)
    if out == Path("-"):
        typer.echo(credential.toml(), nl=False)
        return
    path = out or Path(f"{name}.operator.toml")
    write_secret_file(path, credential.toml())
    console.print(
        f"operator [bold]{name}[/bold] added (reads the fleet's topics, writes none); "
        f"credential in {path} (0600)",
        highlight=False,
    )


@app.command("list")
@friendly_errors
def list_(
    home: HomeOption = DEFAULT_HOME,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List operator accounts (names and creation times; never their secrets).

    Example: fedge manager operator list
    """
    operators = list_operators(ManagerHome(home))
    if as_json:
        print_json([{"name": o.name, "created_at": o.created_at} for o in operators])
        return
    if not operators:
        console.print("no operators; add one with `fedge manager operator add NAME`")
    for operator in operators:
        created = datetime.datetime.fromtimestamp(operator.created_at).isoformat(" ", "seconds")
        console.print(f"{operator.name}\tcreated {created}", highlight=False)


@app.command()
@friendly_errors
def remove(name: str, home: HomeOption = DEFAULT_HOME) -> None:
    """Remove an operator's broker account (a running managed broker is reloaded).

    Example: fedge manager operator remove alice
    """
    remove_operator(ManagerHome(home), name)
    console.print(f"operator [bold]{name}[/bold] removed", highlight=False)


@friendly_errors
def watch(
    credential: Annotated[
        Path | None, typer.Option(help="An operator credential file (operator add --out).")
    ] = None,
    operator: Annotated[
        str | None, typer.Option(help="Or an operator of this manager home, by name.")
    ] = None,
    edge: Annotated[str | None, typer.Option(help="Only this edge.")] = None,
    count: Annotated[int, typer.Option(help="Stop after this many messages (0: never).")] = 0,
    seconds: Annotated[float, typer.Option(help="Stop after this long (0: never).")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Print what the fleet's edges send up, decoded, as an operator (read-only).

    Example: fedge manager watch --credential alice.operator.toml --edge st-01
    """
    chosen = _credential(credential, operator, home)
    watcher = FleetWatcher(chosen, edge)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    watcher.start()
    deadline = time.monotonic() + seconds if seconds > 0 else None
    shown = 0
    try:
        while not stop.is_set() and (count <= 0 or shown < count):
            if deadline is not None and time.monotonic() >= deadline:
                break
            seen = watcher.next(0.2)
            if seen is None:
                continue
            shown += 1
            if as_json:
                fields = {"edge": seen.edge, "kind": seen.kind, "retained": seen.retained}
                typer.echo(json.dumps({**fields, "message": seen.document}))
            else:
                mark = " (retained)" if seen.retained else ""
                console.print(
                    f"{seen.edge} {seen.kind}{mark}: {escape(seen.summary)}", highlight=False
                )
    finally:
        watcher.stop()


def _credential(path: Path | None, operator: str | None, home: Path) -> OperatorCredential:
    if (path is None) == (operator is None):
        raise ManagerError("give exactly one of --credential FILE or --operator NAME")
    if path is not None:
        return load_credential(path)
    assert operator is not None
    return operator_credential(ManagerHome(home), operator)

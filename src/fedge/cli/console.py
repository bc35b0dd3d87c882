"""``fedge console``: the operator console (issue 14), and the tokens people log in with."""

from typing import Annotated

import typer

from fedge.cli.common import (
    DEFAULT_HOME,
    HomeOption,
    console,
    err_console,
    fitted_table,
    friendly_errors,
    when,
)
from fedge.console import accounts
from fedge.console.address import DEFAULT_HOST, DEFAULT_PORT, is_loopback, wants_tls
from fedge.edge_manager.fleet.operations import opened
from fedge.edge_manager.home.layout import ManagerHome

app = typer.Typer(
    help="Serve the operator console (the fleet in a browser); manage its login tokens.",
    invoke_without_command=True,
)
token_app = typer.Typer(help="Console login tokens.", no_args_is_help=True)
app.add_typer(token_app, name="token")


@app.callback()
@friendly_errors
def run(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="TCP port to serve on.")] = DEFAULT_PORT,
    host: Annotated[str, typer.Option(help="Address to bind (127.0.0.1: this machine only).")] = (
        DEFAULT_HOST
    ),
    tls: Annotated[
        bool | None,
        typer.Option(
            "--tls/--no-tls",
            help="HTTPS with a certificate from the fleet CA (default: on when the address "
            "is reachable from other machines and the home has a fleet CA; --no-tls behind "
            "a TLS proxy).",
        ),
    ] = None,
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Serve the console over the manager's store (Ctrl-C stops it).

    Example: fedge console --port 8470
    """
    if ctx.invoked_subcommand is not None:
        return
    manager_home = ManagerHome(home)
    tls = wants_tls(host, tls, manager_home.pki().exists())
    if not tls and not is_loopback(host):
        err_console.print(
            f"[yellow]warning:[/yellow] {host} is reachable from other machines and the "
            "console speaks plain HTTP: serve it with --tls (a fleet CA certificate) or "
            "behind a TLS proxy before operators log in from afar",
            highlight=False,
        )
    # Imported here: every other command (an agent's too) starts without the web stack.
    from fedge.console.server import serve

    serve(
        manager_home,
        host,
        port,
        announce=lambda url: console.print(
            f"fedge console at {url} (log in with a token"
            + (", or an operator certificate)" if tls else ")")
        ),
        tls=tls,
    )


@token_app.command("add")
@friendly_errors
def token_add(
    name: str,
    role: Annotated[str, typer.Option(help="viewer, operator or admin.")] = "viewer",
    home: HomeOption = DEFAULT_HOME,
) -> None:
    """Issue a login token (printed once; only its hash is kept). Replaces NAME's old one.

    Example: fedge console token add alice --role operator
    """
    parsed = accounts.parse_role(role)
    with opened(ManagerHome(home)) as fleet:
        token = accounts.add_token(fleet.store, name, parsed)
    typer.echo(token)  # plain stdout: scripts capture it, nothing else is printed there
    err_console.print(f"console token for {name} ({parsed.value}); it is not shown again")


@token_app.command("list")
@friendly_errors
def token_list(home: HomeOption = DEFAULT_HOME) -> None:
    """Console accounts and their roles (never tokens).

    Example: fedge console token list
    """
    with opened(ManagerHome(home)) as fleet:
        found = accounts.list_accounts(fleet.store)
    table = fitted_table("name", "role", "created")
    for account in found:
        table.add_row(account.name, account.role.value, when(account.created_at))
    console.print(table)


@token_app.command("remove")
@friendly_errors
def token_remove(name: str, home: HomeOption = DEFAULT_HOME) -> None:
    """Remove NAME's token; its open sessions end on their next request.

    Example: fedge console token remove alice
    """
    with opened(ManagerHome(home)) as fleet:
        accounts.remove_token(fleet.store, name)
    console.print(f"removed console token of {name}")

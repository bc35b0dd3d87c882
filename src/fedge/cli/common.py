"""Shared CLI plumbing: the manager home option, error rendering, JSON output."""

import datetime
import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedge.edge_manager.fleet import Fleet
from fedge.edge_manager.home import ManagerHome
from fedge.errors import FedgeError

console = Console()
err_console = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")

HomeOption = Annotated[
    Path,
    typer.Option(
        "--home",
        envvar="FEDGE_HOME",
        help="Manager home directory (store, keys, artifacts).",
        show_default=True,
    ),
]
DEFAULT_HOME = Path("fedge-home")


# What `pip install 'fedge[agent]'` leaves out: the commands that need these import them
# in their bodies, so on a station they fail with one line instead of a traceback.
TRAINING_MODULES = frozenset({"torch", "flwr", "onnx", "ray", "sklearn", "matplotlib"})


def friendly_errors(func: Callable[P, R]) -> Callable[P, R]:
    """The one place where fedge errors become a red line and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except FedgeError as exc:
            # Escaped: messages quote TOML tables and options ("[strategies.tiered]"),
            # which rich would otherwise take for markup and drop.
            err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
            raise typer.Exit(1) from None
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").partition(".")[0]
            if missing not in TRAINING_MODULES:
                raise
            err_console.print(
                f"[red]error:[/red] this command needs {missing}, which this install lacks; "
                "install the training side with: pip install 'fedge\\[train]'",
                highlight=False,
            )
            raise typer.Exit(1) from None

    return wrapper


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def open_fleet(home_path: Path) -> tuple[ManagerHome, Fleet]:
    home = ManagerHome(home_path)
    return home, Fleet.open(home)


def print_json(data: Any) -> None:
    """JSON on stdout for scripts: plain text (no colour codes, never wrapped)."""
    typer.echo(json.dumps(data, indent=2, default=str))


def when(ts: float | None) -> str:
    """A record's time for people: local date and time to the second, or '-'."""
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(float(ts)).strftime("%Y-%m-%d %H:%M:%S")


def fitted_table(*headers: str, title: str | None = None) -> Table:
    """A table whose cells wrap (long words folded) rather than end in '…' at 80 columns."""
    table = Table(title=title)
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


def write_secret_file(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)

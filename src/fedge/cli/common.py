"""Shared CLI plumbing: the manager home option, error rendering, JSON output."""

import dataclasses
import datetime
import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome
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
TRAINING_MODULES = frozenset({"torch", "flwr", "onnx", "ray", "sklearn", "matplotlib", "optuna"})
CONSOLE_MODULES = frozenset({"starlette", "jinja2", "uvicorn", "multipart"})


def friendly_errors(func: Callable[P, R]) -> Callable[P, R]:
    """The one place where fedge errors become a red line and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except FedgeError as exc:
            # Escaped: messages quote TOML tables and options ("[strategies.tiered]"),
            # which rich would otherwise take for markup and drop.
            # One line, however long: the terminal wraps it, and a path in it stays whole
            # for copying (rich would break it at the console's width).
            err_console.print(
                f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True
            )
            raise typer.Exit(1) from None
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").partition(".")[0]
            if missing in CONSOLE_MODULES:
                extra = "the console with: pip install 'fedge\\[console]'"
            elif missing in TRAINING_MODULES:
                extra = "the training side with: pip install 'fedge\\[train]'"
            else:
                raise
            err_console.print(
                f"[red]error:[/red] this command needs {missing}, which this install lacks; "
                f"install {extra}",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None

    return wrapper


def setup_logging(
    verbose: bool = False,
    *,
    log_file: Path | None = None,
    max_bytes: int = 10 * 1024 * 1024,
    backups: int = 5,
) -> None:
    """Log to stderr, or to ``log_file`` rotated at ``max_bytes`` keeping ``backups`` old files."""
    handlers: list[logging.Handler] | None = None
    if log_file is not None:
        from logging.handlers import RotatingFileHandler

        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers = [RotatingFileHandler(log_file, maxBytes=max_bytes, backupCount=backups)]
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
    )


def warn_if_not_serving(home_path: Path, consequence: str) -> None:
    """A yellow line on stderr when no `manager serve` will act on what was just stored.

    Still exit 0: the store has it, and serve publishes it once it runs (issue 15: with
    serve down, set-threshold said nothing).
    """
    from fedge.edge_manager.home.run_dir import serve_notice

    notice = serve_notice(home_path, consequence)
    if notice is not None:
        err_console.print(f"[yellow]warning:[/yellow] {escape(notice)}", highlight=False)


def open_fleet(home_path: Path) -> tuple[ManagerHome, Fleet]:
    home = ManagerHome(home_path)
    return home, Fleet.open(home)


def print_json(data: Any) -> None:
    """JSON on stdout for scripts: plain text (no colour codes, never wrapped). A
    dataclass is printed as its fields; anything else JSON lacks, as its ``str``."""
    typer.echo(json.dumps(data, indent=2, default=_plain))


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def when(ts: float | None) -> str:
    """A record's time for people: local date and time to the second, or '-'."""
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(float(ts)).strftime("%Y-%m-%d %H:%M:%S")


def fitted_table(*headers: str, whole: tuple[str, ...] = (), title: str | None = None) -> Table:
    """A table that fits 80 columns: cells wrap at spaces (a word longer than its column is
    folded) rather than end in '…', and no borders take room from the content.

    Columns named in ``whole`` (ids people copy) never wrap; the others give way.
    """
    # One space between columns, a rule under the header: 80 columns hold an id of 34
    # characters beside five short columns (issue 15: "comple…" at 80 columns).
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=0)
    for header in headers:
        if header in whole:
            table.add_column(header, no_wrap=True, min_width=len(header))
        else:
            table.add_column(header, overflow="fold")
    return table


def write_secret_file(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)

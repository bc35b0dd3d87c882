"""Shared CLI plumbing: the manager home option, error rendering, JSON output."""

import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from rich.console import Console

from fedge.edge_manager.fleet import Fleet
from fedge.edge_manager.home import ManagerHome
from fedge.edge_manager.registry import Registry
from fedge.edge_manager.store import Store
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
            err_console.print(f"[red]error:[/red] {exc}", highlight=False)
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
    settings = home.settings()
    store = Store(home.db_path)
    key = home.signing_key()
    registry = Registry(store, home.artifacts, key)
    return home, Fleet(store, settings.fleet, key, registry, settings.grpc_target)


def print_json(data: Any) -> None:
    console.print_json(json.dumps(data, default=str))


def write_secret_file(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)

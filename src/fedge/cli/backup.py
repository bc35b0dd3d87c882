"""``fedge manager backup`` / ``fedge manager restore`` (wired into cli/manager.py)."""

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fedge.cli.common import DEFAULT_HOME, HomeOption, console, friendly_errors, print_json
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home import backup as backups
from fedge.edge_manager.home import sealing
from fedge.edge_manager.home.layout import ManagerHome

PassphraseFile = Annotated[
    Path | None,
    typer.Option(
        "--passphrase-file",
        help="A file whose first line is the passphrase (never on the command line).",
    ),
]


def _read_passphrase(path: Path) -> bytes:
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ManagerError(f"cannot read the passphrase file {path}: {exc.strerror}") from None
    if not lines or not lines[0]:
        raise ManagerError(f"{path} is empty: write the passphrase on its first line")
    return lines[0]


def _passphrase(path: Path | None, ask: bool, confirm: bool) -> bytes | None:
    if path is not None:
        return _read_passphrase(path)
    if not ask:
        return None
    text: str = typer.prompt("backup passphrase", hide_input=True, confirmation_prompt=confirm)
    return text.encode()


@friendly_errors
def backup(
    out: Annotated[
        Path, typer.Option("--out", help="The backup file to write (never overwritten).")
    ],
    home: HomeOption = DEFAULT_HOME,
    encrypt: Annotated[
        bool, typer.Option("--encrypt", help="Seal it with a passphrase asked for twice.")
    ] = False,
    passphrase_file: PassphraseFile = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Back up the manager home (store, SuperLink state, registry, PKI, keys) to one file,
    while serve runs.

    The store is copied through SQLite's online backup API as of one transaction; records
    acknowledged after that are not in the backup (see docs/operations.md).

    Example: fedge manager backup --out /backups/plant-a.fbk --passphrase-file /root/bk.pass
    """
    passphrase = _passphrase(passphrase_file, encrypt, confirm=True)
    report = backups.backup(ManagerHome(home), out, passphrase)
    if as_json:
        print_json(report)
        return
    counts = ", ".join(f"{n} {table}" for table, n in report.records.items())
    console.print(
        escape(
            f"backed up {report.fleet} to {report.path} ({report.files} files, "
            f"{report.bytes / 2**20:.1f} MiB, {'sealed' if report.sealed else 'NOT encrypted'})"
            f"; the store as of {report.created_at:.3f}: {counts}"
        ),
        highlight=False,
    )


@friendly_errors
def restore(
    archive: Annotated[Path, typer.Argument(help="A file `fedge manager backup` wrote.")],
    home: HomeOption = DEFAULT_HOME,
    replace: Annotated[
        bool,
        typer.Option("--replace", help="Move an existing home aside (kept, renamed) first."),
    ] = False,
    passphrase_file: PassphraseFile = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Restore a manager home from a backup, e.g. on a fresh host; then start it with
    `fedge manager up`. Stations reconnect with their certificates as they are.

    Example: fedge manager restore /backups/plant-a.fbk --home /srv/fedge-home
    """
    sealed = archive.is_file() and sealing.is_sealed(archive)
    passphrase = _passphrase(passphrase_file, sealed, confirm=False)
    report = backups.restore(archive, home, passphrase, replace=replace)
    if as_json:
        print_json(report)
        return
    aside = f"; the home that was there is now {report.moved_aside}" if report.moved_aside else ""
    console.print(
        escape(
            f"restored {report.fleet} into {report.home} ({report.files} files, store schema "
            f"version {report.schema_version}, backed up at {report.created_at:.3f}){aside}"
        ),
        highlight=False,
    )

"""What every ``fedge bench`` command shares: the ``--json`` option and running a
benchmark with a live status line (stdout carries nothing but the JSON)."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from fedge.cli.common import err_console

JsonOption = Annotated[
    Path | None, typer.Option("--json", help="Also write the result to this file.")
]
TlsOption = Annotated[
    bool,
    typer.Option(
        "--tls", help="Also run the fleet on mutual TLS; report both runs and TLS / plain."
    ),
]


def run_bench(
    title: str, json_path: Path | None, bench: Callable[[Callable[[str], None]], Any]
) -> None:
    with err_console.status(title) as status:

        def progress(line: str) -> None:
            status.update(f"{title}: {line}")

        result = bench(progress)
    text = json.dumps(result, indent=2)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    typer.echo(text)
    if not result.get("met_target", True):
        err_console.print(f"[yellow]{title}: target missed[/yellow] (see the JSON)")

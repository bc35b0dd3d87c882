"""``fedge bench console``: its options and wiring (registered by :mod:`fedge.cli.bench`)."""

from pathlib import Path
from typing import Annotated

import typer


def console(
    edges: Annotated[
        int, typer.Option(help="Edges in the fleet (one of them a real agent).", min=2)
    ] = 1000,
    samples: Annotated[int, typer.Option(help="Fleet page requests timed.", min=5)] = 50,
    changes: Annotated[int, typer.Option(help="Threshold changes timed to the page.", min=1)] = 30,
    labels: Annotated[
        int, typer.Option(help="Labels given by keyboard in Chromium, timed (issue 30).", min=5)
    ] = 20,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the result to this file.")
    ] = None,
    screenshot: Annotated[
        Path | None,
        typer.Option(help="Also save a PNG of the fleet page (headless Chromium), e.g. for docs."),
    ] = None,
) -> None:
    """The console's fleet page at fleet scale, how soon an applied threshold shows, and
    labelling with a station's images (label until the next image shows; image view).

    Example: fedge bench console --edges 1000 --json out.json
    """
    from fedge.bench.console import run_console_bench
    from fedge.cli.bench_common import run_bench

    run_bench(
        "console",
        json_path,
        lambda progress: run_console_bench(
            edges, samples, changes, progress=progress, screenshot=screenshot, labels=labels
        ),
    )

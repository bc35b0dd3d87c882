"""``fedge bench``: benchmarks that print JSON (see bench/README.md and BENCHMARKS.md).

The commands only parse options, run a :mod:`fedge.bench` function with a live status
line on stderr (stdout carries nothing but the JSON), print the result and optionally
write it to ``--json PATH``.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from fedge.cli.common import err_console, friendly_errors

app = typer.Typer(
    help="Benchmarks (JSON output, machine named, peer side by side).", no_args_is_help=True
)

JsonOption = Annotated[
    Path | None, typer.Option("--json", help="Also write the result to this file.")
]


def _run(title: str, json_path: Path | None, bench: Callable[[Callable[[str], None]], Any]) -> None:
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


@app.command("config-push")
@friendly_errors
def config_push(
    edges: Annotated[int, typer.Option(help="Simulated edges (one MQTT session each).")] = 1000,
    repeats: Annotated[int, typer.Option(help="Pushes to measure, a new version each.")] = 3,
    workers: Annotated[int, typer.Option(help="Processes the edges are spread over.")] = 4,
    threshold: Annotated[float, typer.Option(help="Threshold of the first push.")] = 0.72,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for any one step.")] = 60.0,
    json_path: JsonOption = None,
) -> None:
    """Push a threshold to N edges; time until the manager stores every edge's report.

    Example: fedge bench config-push --edges 1000 --json out.json
    """
    from fedge.bench.config_push import run_config_push

    _run(
        "config-push",
        json_path,
        lambda progress: run_config_push(
            edges,
            repeats=repeats,
            workers=workers,
            threshold=threshold,
            timeout_s=timeout,
            progress=progress,
        ),
    )


@app.command()
@friendly_errors
def ingest(
    records: Annotated[int, typer.Option(help="Telemetry records to ingest.")] = 200_000,
    repeats: Annotated[int, typer.Option(help="Runs, each on a fresh broker and store.")] = 3,
    edges: Annotated[int, typer.Option(help="Edges publishing them.")] = 8,
    publishers: Annotated[int, typer.Option(help="Publisher processes.")] = 2,
    batch_records: Annotated[int, typer.Option(help="Records per RecordBatch.")] = 500,
    duplicate_fraction: Annotated[
        float, typer.Option(help="Share of batches published twice (redelivery).")
    ] = 0.01,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for any one step.")] = 300.0,
    json_path: JsonOption = None,
) -> None:
    """Publish telemetry batches QoS 1; time until the manager stores every record once.

    Example: fedge bench ingest --records 200000 --json out.json
    """
    from fedge.bench.ingest import run_ingest

    _run(
        "ingest",
        json_path,
        lambda progress: run_ingest(
            records,
            repeats=repeats,
            edges=edges,
            publishers=publishers,
            batch_records=batch_records,
            duplicate_fraction=duplicate_fraction,
            timeout_s=timeout,
            progress=progress,
        ),
    )


@app.command()
@friendly_errors
def inference(
    images: Annotated[int, typer.Option(help="Distinct decoded 32x32 images.")] = 500,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds (agent vs raw).")] = 7,
    per_round: Annotated[int, typer.Option(help="Images timed per side per round.")] = 200,
    epochs: Annotated[int, typer.Option(help="Training epochs of the benchmark CNN.")] = 3,
    train_images: Annotated[int, typer.Option(help="Training images for the CNN.")] = 4000,
    json_path: JsonOption = None,
) -> None:
    """Time agent.score against a bare ONNX Runtime loop on the same images.

    Example: fedge bench inference --json out.json
    """
    from fedge.bench.inference import run_inference

    _run(
        "inference",
        json_path,
        lambda progress: run_inference(
            images,
            rounds=rounds,
            per_round=per_round,
            epochs=epochs,
            train_images=train_images,
            progress=progress,
        ),
    )

"""``fedge bench config-push`` and ``fedge bench ingest``: the fleet's MQTT paths under
load, plain and (``--tls``) mutual TLS side by side; ``metrics`` and ``heartbeat``: what
scraping and liveness cost at fleet scale (registered by :mod:`fedge.cli.bench`).
"""

from typing import Annotated

import typer

from fedge.cli.bench_common import JsonOption, TlsOption, run_bench


def config_push(
    edges: Annotated[int, typer.Option(help="Simulated edges (one MQTT session each).")] = 1000,
    repeats: Annotated[int, typer.Option(help="Pushes to measure, a new version each.")] = 3,
    workers: Annotated[int, typer.Option(help="Processes the edges are spread over.")] = 4,
    threshold: Annotated[float, typer.Option(help="Threshold of the first push.")] = 0.72,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for any one step.")] = 60.0,
    tls: TlsOption = False,
    json_path: JsonOption = None,
) -> None:
    """Push a threshold to N edges; time until the manager stores every edge's report.

    Example: fedge bench config-push --edges 1000 --tls --json out.json
    """
    from fedge.bench.config_push import run_config_push

    run_bench(
        "config-push",
        json_path,
        lambda progress: run_config_push(
            edges,
            repeats=repeats,
            workers=workers,
            threshold=threshold,
            timeout_s=timeout,
            tls=tls,
            progress=progress,
        ),
    )


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
    tls: TlsOption = False,
    json_path: JsonOption = None,
) -> None:
    """Publish telemetry batches QoS 1; time until the manager stores every record once.

    Example: fedge bench ingest --records 200000 --tls --json out.json
    """
    from fedge.bench.ingest import run_ingest

    run_bench(
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
            tls=tls,
            progress=progress,
        ),
    )


def metrics(
    edges: Annotated[int, typer.Option(help="Enrolled stations, each stored online.")] = 1000,
    records: Annotated[int, typer.Option(help="Telemetry records ingested per run.")] = 400_000,
    repeats: Annotated[int, typer.Option(help="Runs of each side (metrics off, on).")] = 3,
    scrape_interval: Annotated[
        float, typer.Option(help="Seconds between scrapes while ingesting.")
    ] = 1.0,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for any one step.")] = 300.0,
    json_path: JsonOption = None,
) -> None:
    """Scrape manager serve's /metrics at N stations; ingest with metrics vs without.

    Example: fedge bench metrics --edges 1000 --json out.json
    """
    from fedge.bench.metrics import run_metrics

    run_bench(
        "metrics",
        json_path,
        lambda progress: run_metrics(
            edges,
            records=records,
            repeats=repeats,
            scrape_interval_s=scrape_interval,
            timeout_s=timeout,
            progress=progress,
        ),
    )


def heartbeat(
    edges: Annotated[int, typer.Option(help="Simulated stations (one MQTT session each).")] = 1000,
    heartbeat_s: Annotated[
        float, typer.Option("--heartbeat", help="Seconds between a station's births.")
    ] = 2.5,
    lost_after: Annotated[
        float, typer.Option(help="Seconds of silence after which serve marks a station lost.")
    ] = 7.0,
    phase: Annotated[float, typer.Option(help="Seconds measured on each side.")] = 60.0,
    workers: Annotated[int, typer.Option(help="Processes the stations are spread over.")] = 4,
    cut: Annotated[int, typer.Option(help="Stations cut after the phase, timed to lost.")] = 10,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for any one step.")] = 120.0,
    json_path: JsonOption = None,
) -> None:
    """Broker and manager CPU of liveness heartbeats at N stations, vs none; cut to lost.

    Example: fedge bench heartbeat --edges 1000 --json out.json
    """
    from fedge.bench.heartbeat import run_heartbeat

    run_bench(
        "heartbeat",
        json_path,
        lambda progress: run_heartbeat(
            edges,
            heartbeat_s=heartbeat_s,
            lost_after_s=lost_after,
            phase_s=phase,
            workers=workers,
            cut=cut,
            timeout_s=timeout,
            progress=progress,
        ),
    )

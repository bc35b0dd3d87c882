"""``fedge bench secagg``: its options and wiring (registered by :mod:`fedge.cli.bench`)."""

from pathlib import Path
from typing import Annotated

import typer


def secagg(
    parties: Annotated[
        int,
        typer.Option(help="Simulated parties (Flower supernodes), all asked each round.", min=4),
    ] = 10,
    params: Annotated[
        int, typer.Option(help="Parameters of the synthetic model.", min=2)
    ] = 1_000_000,
    rounds: Annotated[
        int, typer.Option(help="Timed rounds of each kind (after 1 untimed warm-up).", min=1)
    ] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the model and the strategies.")] = 0,
    cpus: Annotated[int, typer.Option(help="Ray CPUs (one ClientApp actor each).", min=1)] = 2,
    silent_parties: Annotated[
        int,
        typer.Option(
            help="Real SuperNodes in the silent-dropout round (one is SIGKILLed mid-round); "
            "0 skips it.",
            min=0,
        ),
    ] = 5,
    silent_params: Annotated[
        int, typer.Option(help="Parameters of the silent round's model.", min=2)
    ] = 100_000,
    silent_timeout: Annotated[
        float,
        typer.Option(help="Seconds the silent round's masked-vector stage waits.", min=1.0),
    ] = 30.0,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the result to this file.")
    ] = None,
) -> None:
    """SecAgg+ rounds against plain FedAvg rounds of the same parties, in one simulation.

    Then one SecAgg+ round on real processes (a SuperLink and --silent-parties SuperNodes)
    in which one SuperNode is SIGKILLed after the key stages: silent_dropouts_survived.

    Example: fedge bench secagg --parties 10 --params 1000000 --json out.json
    """
    from fedge.bench.secagg import run_secagg_bench
    from fedge.bench.secagg_silent import SilentSettings
    from fedge.cli.bench_common import run_bench

    silent = None
    if silent_parties:
        silent = SilentSettings(
            silent_parties, silent_params, seed, collect_timeout_s=silent_timeout
        )
    run_bench(
        "secagg",
        json_path,
        lambda progress: run_secagg_bench(
            parties, params, rounds, seed=seed, num_cpus=cpus, progress=progress, silent=silent
        ),
    )

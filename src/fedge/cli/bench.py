"""``fedge bench``: benchmarks that print JSON (see bench/README.md and BENCHMARKS.md).

The commands only parse options, run a :mod:`fedge.bench` function with a live status
line on stderr (stdout carries nothing but the JSON), print the result and optionally
write it to ``--json PATH``.
"""

from typing import Annotated

import typer

from fedge.cli.bench_common import JsonOption, run_bench
from fedge.cli.bench_console import console
from fedge.cli.bench_fleet import config_push, heartbeat, ingest, metrics
from fedge.cli.bench_secagg import secagg
from fedge.cli.common import friendly_errors

app = typer.Typer(
    help="Benchmarks (JSON output, machine named, peer side by side).", no_args_is_help=True
)
app.command("secagg")(friendly_errors(secagg))  # wired in fedge.cli.bench_secagg
app.command("console")(friendly_errors(console))  # wired in fedge.cli.bench_console
app.command("config-push")(friendly_errors(config_push))  # fedge.cli.bench_fleet
app.command("ingest")(friendly_errors(ingest))  # fedge.cli.bench_fleet
app.command("metrics")(friendly_errors(metrics))  # fedge.cli.bench_fleet
app.command("heartbeat")(friendly_errors(heartbeat))  # fedge.cli.bench_fleet


@app.command()
@friendly_errors
def inference(
    path: Annotated[
        str,
        typer.Option(
            help="The single-image path timed: library (score_image), api (POST /v1/score), "
            "inbox (a file in the watched directory, on its inotify event) or inbox-scan "
            "(the same found by the watcher's scans)."
        ),
    ] = "library",
    kept: Annotated[
        int,
        typer.Option(
            help="Images the station keeps before timing (the growth is measured against a "
            "fresh station in the same run).",
            min=0,
        ),
    ] = 0,
    images: Annotated[int, typer.Option(help="Distinct images (PNG files).")] = 500,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds (agent vs raw).")] = 7,
    per_round: Annotated[int, typer.Option(help="Images timed per side per round.")] = 200,
    batch_size: Annotated[
        int, typer.Option(help="Images per agent.score_many call in the batched rounds.", min=1)
    ] = 32,
    image_size: Annotated[
        int,
        typer.Option(
            help="Side in pixels of the square grayscale images (training, model input, "
            "decoded images, the agent's image_size); 32 shows the agent's fixed overhead.",
            min=8,
        ),
    ] = 128,
    epochs: Annotated[
        int | None,
        typer.Option(help="Training epochs of the benchmark CNN (default: 3 up to 32 px, else 2)."),
    ] = None,
    train_images: Annotated[
        int | None,
        typer.Option(help="Training images for the CNN (default: 4000 up to 32 px, else 1500)."),
    ] = None,
    json_path: JsonOption = None,
) -> None:
    """Time a station's scoring path (one image, and batched) against bare ONNX Runtime.

    Example: fedge bench inference --path api --kept 5000 --json out.json
    """
    from fedge.bench.inference import run_inference

    run_bench(
        "inference",
        json_path,
        lambda progress: run_inference(
            images,
            path=path,
            kept=kept,
            rounds=rounds,
            per_round=per_round,
            batch_size=batch_size,
            image_size=image_size,
            epochs=epochs,
            train_images=train_images,
            progress=progress,
        ),
    )


@app.command()
@friendly_errors
def aggregate(
    updates: Annotated[int, typer.Option(help="Replies aggregated in the round.", min=1)] = 200,
    params: Annotated[
        int, typer.Option(help="Parameters of the float32 model in each reply.", min=100)
    ] = 10_000_000,
    seed: Annotated[int, typer.Option(help="Seed of the generated replies.")] = 0,
    json_path: JsonOption = None,
) -> None:
    """Peak memory and time of our streaming fold vs Flower's FedAvg on the same replies.

    Example: fedge bench aggregate --updates 200 --params 10000000 --json out.json
    """
    from fedge.bench.aggregate import run_aggregate

    run_bench(
        "aggregate",
        json_path,
        lambda progress: run_aggregate(updates, params, seed=seed, progress=progress),
    )


@app.command("sim-overhead")
@friendly_errors
def sim_overhead(
    parties: Annotated[
        int, typer.Option(help="Simulated parties (Flower supernodes).", min=2)
    ] = 20,
    per_round: Annotated[int, typer.Option(help="Parties asked per round.", min=1)] = 10,
    rounds: Annotated[
        int, typer.Option(help="Timed rounds per run (after 1 untimed warm-up round).", min=1)
    ] = 20,
    repeats: Annotated[int, typer.Option(help="Runs per side (medians reported).", min=1)] = 5,
    params: Annotated[int, typer.Option(help="Parameters of the echoed model.", min=2)] = 10_000,
    seed: Annotated[int, typer.Option(help="Seed of the strategy and the model.")] = 0,
    cpus: Annotated[int, typer.Option(help="Ray CPUs (one ClientApp actor each).", min=1)] = 2,
    json_path: JsonOption = None,
) -> None:
    """Seconds per party-round: in-process grid vs Flower's runtime (ours and FedAvg).

    Example: fedge bench sim-overhead --json out.json
    """
    from fedge.bench.sim_overhead import run_sim_overhead

    run_bench(
        "sim-overhead",
        json_path,
        lambda progress: run_sim_overhead(
            parties,
            per_round,
            rounds,
            repeats,
            params=params,
            seed=seed,
            num_cpus=cpus,
            progress=progress,
        ),
    )


@app.command("sim-scale")
@friendly_errors
def sim_scale(
    parties: Annotated[
        str, typer.Option(help="Fleet sizes, comma-separated (each in a fresh process).")
    ] = "1000,10000",
    rounds: Annotated[int, typer.Option(help="Rounds per size (the first is untimed).", min=2)] = 5,
    scenario: Annotated[str, typer.Option(help="Scenario name or path.")] = "fleet-scale",
    strategy: Annotated[str, typer.Option(help="The scenario's strategy to run.")] = "fedavg",
    seed: Annotated[int, typer.Option(help="Seed of the split and the strategy.")] = 0,
    peer_max: Annotated[
        int,
        typer.Option(
            help="Run sizes up to this on Flower's simulation runtime too (0: none).", min=0
        ),
    ] = 1000,
    json_path: JsonOption = None,
) -> None:
    """Time per round and peak memory of the simulator at fleet sizes (and Flower's runtime).

    Example: fedge bench sim-scale --parties 1000,10000 --json out.json
    """
    from fedge.bench.sim_scale import run_sim_scale

    try:
        sizes = [int(part) for part in parties.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"a comma-separated list of integers, got {parties!r}", param_hint="--parties"
        ) from None
    run_bench(
        "sim-scale",
        json_path,
        lambda progress: run_sim_scale(
            sizes,
            rounds=rounds,
            scenario=scenario,
            strategy=strategy,
            seed=seed,
            peer_max=peer_max,
            progress=progress,
        ),
    )


@app.command()
@friendly_errors
def distill(
    scenario: Annotated[str, typer.Option(help="Scenario name or path.")] = "tifl-digits",
    seed: Annotated[int, typer.Option(help="Seed of the split and of every model.")] = 0,
    seeds: Annotated[
        int | None,
        typer.Option(help="Run seeds 0..N-1 instead of --seed; report medians.", min=1),
    ] = None,
    rounds: Annotated[
        int | None,
        typer.Option(
            help="FedAvg rounds of the student-alone baseline (default: scenario's).", min=1
        ),
    ] = None,
    json_path: JsonOption = None,
) -> None:
    """Distil mlp-large into mlp-small on the proxy split; compare with FedAvg mlp-small.

    Example: fedge bench distill --seeds 5 --json out.json
    """
    from fedge.bench.distill import run_distill, run_distill_seeds

    if seeds is not None:
        if seed != 0:
            raise typer.BadParameter("give --seed or --seeds, not both", param_hint="--seed")
        run_bench(
            "distill",
            json_path,
            lambda progress: run_distill_seeds(scenario, seeds, rounds=rounds, progress=progress),
        )
        return
    run_bench(
        "distill",
        json_path,
        lambda progress: run_distill(scenario, seed, rounds=rounds, progress=progress),
    )


@app.command()
@friendly_errors
def mpp(
    seed: Annotated[int, typer.Option(help="Seed of the data and the primary model.")] = 0,
    seeds: Annotated[
        int | None,
        typer.Option(help="Run seeds 0..N-1 instead of --seed; report medians.", min=1),
    ] = None,
    train_images: Annotated[
        int, typer.Option(help="Primary model's training images.", min=10)
    ] = 4000,
    epochs: Annotated[int, typer.Option(help="Primary model's training epochs.", min=1)] = 4,
    gate_images: Annotated[
        int, typer.Option(help="Held-out gate images (fit MPP).", min=10)
    ] = 2000,
    test_images: Annotated[int, typer.Option(help="Images per scenario.", min=1)] = 2000,
    stream_before: Annotated[
        int, typer.Option(help="In-distribution images before the shift.", min=1)
    ] = 1000,
    stream_after: Annotated[int, typer.Option(help="Shifted images after it.", min=1)] = 400,
    window: Annotated[int, typer.Option(help="Drift window (images).", min=2)] = 100,
    step: Annotated[int, typer.Option(help="Images the window slides by.", min=1)] = 10,
    json_path: JsonOption = None,
) -> None:
    """Label-free accuracy (MPP) per scenario and drift-alert delay on image streams.

    Example: fedge bench mpp --seeds 5 --json out.json
    """
    from fedge.bench.mpp import MppBenchSize, run_mpp, run_mpp_seeds

    if seeds is not None and seed != 0:
        raise typer.BadParameter("give --seed or --seeds, not both", param_hint="--seed")
    size = MppBenchSize(
        train_images=train_images,
        epochs=epochs,
        gate_images=gate_images,
        test_images=test_images,
        stream_before=stream_before,
        stream_after=stream_after,
        window=window,
        step=step,
    )
    if seeds is not None:
        run_bench(
            "mpp", json_path, lambda progress: run_mpp_seeds(seeds, size=size, progress=progress)
        )
        return
    run_bench("mpp", json_path, lambda progress: run_mpp(seed, size=size, progress=progress))


@app.command()
@friendly_errors
def anomaly(
    seed: Annotated[int, typer.Option(help="Seed of the data and the backbone.")] = 0,
    seeds: Annotated[
        int | None,
        typer.Option(help="Run seeds 0..N-1 instead of --seed; report medians.", min=1),
    ] = 5,
    train_images: Annotated[
        int, typer.Option(help="Scratch images the backbone CNN trains on.", min=10)
    ] = 2000,
    epochs: Annotated[int, typer.Option(help="Backbone CNN's training epochs.", min=1)] = 3,
    station_parts: Annotated[
        str, typer.Option(help="Good parts per station, comma-separated (last: smallest).")
    ] = "600,300,150,20",
    test_images: Annotated[
        int, typer.Option(help="Held-out good parts (and half as many per unseen shape).", min=4)
    ] = 500,
    stages: Annotated[
        int, typer.Option(help="Conv stages of the inspection CNN the backbone uses.", min=1, max=3)
    ] = 1,
    input_scale: Annotated[
        float,
        typer.Option(help="Fixed input scale; 0 = the classifier's per-image normalisation."),
    ] = 20.0,
    json_path: JsonOption = None,
) -> None:
    """Federated anomaly detection from good parts: unseen defects, federated = pooled,
    the smallest station's gain, serving cost beside the classifier.

    Example: fedge bench anomaly --json out.json
    """
    from fedge.bench.anomaly import AnomalyBenchSize, run_anomaly, run_anomaly_seeds

    try:
        parts = tuple(int(value) for value in station_parts.split(","))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--station-parts") from exc
    size = AnomalyBenchSize(
        train_images=train_images,
        epochs=epochs,
        station_parts=parts,
        test_good=test_images,
        test_per_shape=test_images // 2,
        station_test_good=max(2, test_images // 2),
        station_test_per_shape=max(1, test_images // 5),
        stages=stages,
        input_scale=input_scale if input_scale > 0 else None,
    )
    if seed != 0:
        run_bench(
            "anomaly", json_path, lambda progress: run_anomaly(seed, size=size, progress=progress)
        )
        return
    run_bench(
        "anomaly",
        json_path,
        lambda progress: run_anomaly_seeds(seeds or 1, size=size, progress=progress),
    )


@app.command("agent-footprint")
@friendly_errors
def agent_footprint(
    images: Annotated[
        int, typer.Option(help="Images the agent scores before measuring.", min=1)
    ] = 200,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for any one step.")] = 60.0,
    json_path: JsonOption = None,
) -> None:
    """RSS and imports of a running inference-only agent; install size of fedge[agent].

    Example: fedge bench agent-footprint --json out.json
    """
    from fedge.bench.footprint import run_footprint

    run_bench(
        "agent-footprint",
        json_path,
        lambda progress: run_footprint(images, timeout_s=timeout, progress=progress),
    )


@app.command("fleet-round")
@friendly_errors
def fleet_round(
    agents: Annotated[
        int, typer.Option(help="Agent processes, each a training station.", min=1)
    ] = 3,
    rounds: Annotated[int, typer.Option(help="Federated rounds on each side.", min=1)] = 3,
    images: Annotated[
        int, typer.Option(help="Parts each station scores and labels first.", min=10)
    ] = 200,
    json_path: JsonOption = None,
) -> None:
    """Rounds run by fedge's agents vs plain Flower SuperNodes, same SuperLink and work.

    Example: fedge bench fleet-round --agents 3 --rounds 3 --json out.json
    """
    from fedge.bench.fleet_round import run_fleet_round

    run_bench(
        "fleet-round",
        json_path,
        lambda progress: run_fleet_round(agents, rounds, images, progress=progress),
    )


@app.command("dp-sgd")
@friendly_errors
def dp_sgd(
    stations: Annotated[int, typer.Option(help="Stations in the federation.", min=1)] = 3,
    images: Annotated[int, typer.Option(help="Training images per station.", min=16)] = 2000,
    rounds: Annotated[int, typer.Option(help="Federated rounds.", min=1)] = 4,
    batch_size: Annotated[int, typer.Option(help="The batch size (both sides).", min=1)] = 64,
    dp_batch_size: Annotated[
        int | None, typer.Option(help="DP-SGD's own batch size (default: --batch-size).", min=1)
    ] = None,
    dp_lr: Annotated[
        float | None, typer.Option(help="DP-SGD's own learning rate (default: 3e-3).")
    ] = None,
    epsilon: Annotated[float, typer.Option(help="Each station's target for the job.")] = 8.0,
    seed: Annotated[int, typer.Option(help="Data, initial model and noise seed.")] = 0,
    fine_tune: Annotated[
        bool,
        typer.Option(help="Start from a model trained on scratches; stations also see dents."),
    ] = False,
    json_path: JsonOption = None,
) -> None:
    """The stations' inspection CNN with DP-SGD against without: accuracy and round time.

    Example: fedge bench dp-sgd --json dp-sgd.json
    """
    from fedge.bench.dp_sgd import run_dp_sgd

    run_bench(
        "dp-sgd",
        json_path,
        lambda progress: run_dp_sgd(
            stations=stations,
            images=images,
            rounds=rounds,
            batch_size=batch_size,
            dp_batch_size=dp_batch_size,
            dp_lr=dp_lr,
            epsilon=epsilon,
            seed=seed,
            fine_tune=fine_tune,
            progress=progress,
        ),
    )


@app.command()
@friendly_errors
def gpu(
    images: Annotated[int, typer.Option(help="Images per inference pass.", min=32)] = 1024,
    train_images: Annotated[
        int, typer.Option(help="Examples in the training round.", min=32)
    ] = 2000,
    epochs: Annotated[int, typer.Option(help="Epochs of the training round.", min=1)] = 2,
    repeats: Annotated[int, typer.Option(help="Timed passes (median).", min=1)] = 5,
    json_path: JsonOption = None,
) -> None:
    """A station's inference (ONNX Runtime) and training round on its GPU against its CPU.

    Exits with a clear message where there is no GPU.

    Example: fedge bench gpu --json gpu.json
    """
    from fedge.bench.gpu import run_gpu_check

    run_bench(
        "gpu",
        json_path,
        lambda progress: run_gpu_check(
            images=images, train_images=train_images, epochs=epochs, repeats=repeats
        ),
    )


@app.command()
@friendly_errors
def chaos(
    agents: Annotated[int, typer.Option(help="Agent processes (one station each).", min=1)] = 8,
    minutes: Annotated[float, typer.Option(help="Length of the chaos phase.", min=0.2)] = 5.0,
    seed: Annotated[int, typer.Option(help="Seed of the fault schedule and the load.")] = 1,
    disk_agents: Annotated[
        int | None,
        typer.Option(help="Stations on a small tmpfs of their own (disk-full faults; root)."),
    ] = None,
    manager_disk_mb: Annotated[
        int,
        typer.Option(help="The manager home on a tmpfs of this size (manager-disk-full; 0: off)."),
    ] = 256,
    faults_per_minute: Annotated[
        float, typer.Option(help="Faults scheduled per minute of chaos.", min=0.5)
    ] = 10.0,
    heal_timeout: Annotated[
        float, typer.Option(help="Seconds the heal phase may take to settle.")
    ] = 180.0,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the work directory (logs, stores).")
    ] = False,
    json_path: JsonOption = None,
) -> None:
    """Faults on a live fleet (broker, manager, agents, network, disk, models); invariants.

    Example: fedge bench chaos --agents 8 --minutes 5 --seed 1 --json out.json
    """
    from fedge.bench.chaos import run_chaos

    run_bench(
        "chaos",
        json_path,
        lambda progress: run_chaos(
            agents,
            minutes,
            seed,
            disk_agents=disk_agents,
            manager_disk_mb=manager_disk_mb,
            faults_per_minute=faults_per_minute,
            heal_timeout_s=heal_timeout,
            keep=keep,
            progress=progress,
        ),
    )


@app.command("rollout")
@friendly_errors
def rollout(
    edges: Annotated[int, typer.Option(help="Real agents, one process each.")] = 20,
    health_window: Annotated[float, typer.Option(help="Seconds each wave is watched.")] = 3.0,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for any one step.")] = 180.0,
    json_path: JsonOption = None,
) -> None:
    """A bad and a good model rolled out staged to real agents: exposure, rollback time.

    Example: fedge bench rollout --edges 20 --json out.json
    """
    from fedge.bench.rollout import run_rollout_bench

    run_bench(
        "rollout",
        json_path,
        lambda progress: run_rollout_bench(
            edges, health_window_s=health_window, timeout_s=timeout, progress=progress
        ),
    )


@app.command("scheduler")
@friendly_errors
def scheduler(
    jobs: Annotated[int, typer.Option(help="Jobs in the synthetic trace.", min=16)] = 65536,
    te_share: Annotated[
        float, typer.Option(help="Share of trial-and-error (urgent) jobs.", min=0.0, max=1.0)
    ] = 0.3,
    load: Annotated[float, typer.Option(help="Offered load under FIFO (1.0: full).")] = 2.0,
    seeds: Annotated[int, typer.Option(help="Traces drawn (seeds 0..N-1).", min=1)] = 3,
    json_path: JsonOption = None,
) -> None:
    """FitGpp preemption vs FIFO, LRTP and RAND: the scheduler replayed on a virtual clock.

    Example: fedge bench scheduler --jobs 65536 --te-share 0.3 --load 2.0 --seeds 3 --json out.json
    """
    from fedge.bench.scheduler import run_scheduler_bench

    run_bench(
        "scheduler",
        json_path,
        lambda progress: run_scheduler_bench(jobs, te_share, load, seeds, progress=progress),
    )

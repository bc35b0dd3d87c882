"""Inference: the paths a station scores through, against bare ONNX Runtime.

The model is the project's scratch-inspection CNN, trained for a few epochs on generated
images and exported to ONNX in a child process (``python -m fedge.bench.inference_setup train``)
so that torch's thread pools never share this process with the timed loops. Without the
training extra, a small softmax-regression graph built with ``onnx.helper`` stands in.

Real :class:`EdgeAgent` objects (no MQTT: nothing is started) get the model through
``runtime.load`` + ``runtime.smoke_test``, as a deployment would, and an
:class:`EdgeConfig`. Two measurements:

- single (the headline, issue 25): one image at a time through ``--path`` (``library``,
  ``api``, ``inbox`` or ``inbox-scan``) with the station already keeping ``--kept``
  images, against the same decode + preprocess + ``session.run``
  (:mod:`fedge.bench.inference_paths`), and the growth from a fresh station to
  ``--kept`` in the same run;
- batched: ``agent.score_many(images)`` on batches of ``batch_size`` decoded images -- one
  ORT call and one commit per batch, every record durable on return -- against
  ``session.run`` on the same batches already stacked ``(B, 1, H, W)``.

The bare session is created with the agent's SessionOptions and providers. Rounds
interleave the sides, rotating which goes first.

Images are ``image_size`` x ``image_size`` (128 by default, a station camera frame
downscaled for inspection; ``InspectionNet`` is size-agnostic). The CNN is trained, the
model exported, the images made and the agent configured (``AgentSettings.image_size``)
at that one size.
"""

import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from fedge.bench import Progress, inference_paths, no_progress
from fedge.bench.inference_paths import PATHS, Baseline, Sides
from fedge.bench.inference_setup import (
    DEFAULT_IMAGE_SIZE,
    build_model,
    default_training,
    make_agent,
    png_images,
    raw_session,
)
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.inference import runtime
from fedge.edge_agent.inference.images import decode_for

TARGET_RATIO = 1.1  # batched (issue 25: stays within 1.1x)

# ---------------------------------------------------------------- timing


def _time_agent_batched(agent: EdgeAgent, batches: list[list[np.ndarray]]) -> float:
    """ms per image of ``agent.score_many`` (one model call, one commit per batch)."""
    started = time.perf_counter()
    images = 0
    for batch in batches:
        agent.score_many(batch)
        images += len(batch)
    return (time.perf_counter() - started) * 1000.0 / images


def _time_raw_batched(
    session: ort.InferenceSession, stacked: list[np.ndarray], input_name: str, output_name: str
) -> float:
    started = time.perf_counter()
    images = 0
    for batch in stacked:
        session.run([output_name], {input_name: batch})
        images += batch.shape[0]
    return (time.perf_counter() - started) * 1000.0 / images


def _interleaved(
    rounds: int,
    progress: Progress,
    label: str,
    agent_side: Callable[[int], float],
    raw_side: Callable[[int], float],
) -> tuple[list[float], list[float]]:
    """Run both sides ``rounds`` times, alternating which goes first; ms per image each."""
    agent_ms: list[float] = []
    raw_ms: list[float] = []
    for r in range(rounds):
        progress(f"{label}: round {r + 1}/{rounds}")
        if r % 2 == 0:
            agent_ms.append(agent_side(r))
            raw_ms.append(raw_side(r))
        else:
            raw_ms.append(raw_side(r))
            agent_ms.append(agent_side(r))
    return agent_ms, raw_ms


def _summary(agent_ms: list[float], raw_ms: list[float]) -> dict[str, Any]:
    agent_median, raw_median = statistics.median(agent_ms), statistics.median(raw_ms)
    ratio = agent_median / raw_median
    return {
        "agent_ms_per_image": round(agent_median, 4),
        "raw_ort_ms_per_image": round(raw_median, 4),
        "ratio": round(ratio, 4),
        "overhead_ms_per_image": round(agent_median - raw_median, 4),
        "per_round_ms": {
            "agent": [round(v, 4) for v in agent_ms],
            "raw": [round(v, 4) for v in raw_ms],
        },
        "ratio_per_round": [round(a / b, 4) for a, b in zip(agent_ms, raw_ms, strict=True)],
        "met_target": ratio <= TARGET_RATIO,
    }


def _single(
    path: str,
    kept: int,
    full: EdgeAgent,
    fresh: EdgeAgent | None,
    baseline: Baseline,
    pngs: list[bytes],
    root: Path,
    *,
    rounds: int,
    per_round: int,
    progress: Progress,
) -> dict[str, Any]:
    """The single-image measurement of ``path`` (see :mod:`fedge.bench.inference_paths`)."""
    with ExitStack() as stack:
        if path == "library":
            sides = Sides(
                inference_paths.library_side(full),
                None if fresh is None else inference_paths.library_side(fresh),
                inference_paths.library_baseline(baseline),
            )
        elif path == "inbox":
            sides = Sides(
                stack.enter_context(inference_paths.inbox_side(full, root / "full")),
                None
                if fresh is None
                else stack.enter_context(inference_paths.inbox_side(fresh, root / "fresh")),
                inference_paths.inbox_baseline(baseline, root / "baseline"),
            )
        elif path == "inbox-scan":
            sides = Sides(
                inference_paths.inbox_scan_side(full, root / "full"),
                None if fresh is None else inference_paths.inbox_scan_side(fresh, root / "fresh"),
                inference_paths.inbox_baseline(baseline, root / "baseline"),
            )
        else:
            full_port = stack.enter_context(inference_paths.agent_api(full))
            fresh_port = (
                None if fresh is None else stack.enter_context(inference_paths.agent_api(fresh))
            )
            base_port = stack.enter_context(inference_paths.baseline_server(baseline))
            client = stack.enter_context(inference_paths.camera(pngs, root / "camera"))
            sides = Sides(
                inference_paths.api_side(client, full_port),
                None if fresh_port is None else inference_paths.api_side(client, fresh_port),
                inference_paths.api_side(client, base_port),
            )
        samples = inference_paths.time_sides(
            sides,
            pngs,
            rounds=rounds,
            per_round=per_round,
            warmup=min(len(pngs), 20),
            progress=progress,
            label=f"{path}, one image at a time",
        )
    result = inference_paths.summarise(path, kept, samples)
    if path.startswith("inbox"):
        progress("inbox: a file's wait from landing to scored, on events and on the scans")
        result["arrival"] = {
            name: inference_paths.arrival_latency(
                full,
                root / f"arrival-{name}",
                pngs,
                events=name == "events",
                count=min(inference_paths.ARRIVALS_TIMED, per_round),
            )
            for name in ("events", "scan")
        }
    return result


def run_inference(
    images: int = 500,
    *,
    path: str = "library",
    kept: int = 0,
    rounds: int = 7,
    per_round: int = 200,
    batch_size: int = 32,
    image_size: int = DEFAULT_IMAGE_SIZE,
    epochs: int | None = None,
    train_images: int | None = None,
    seed: int = 0,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result (see the module docstring).

    ``epochs`` and ``train_images`` default to :func:`default_training` of ``image_size``.
    """
    if images < 1 or rounds < 1 or per_round < 1 or batch_size < 1:
        raise BenchError("images, rounds, per_round and batch_size must all be at least 1")
    if path not in PATHS:
        raise BenchError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if kept < 0:
        raise BenchError(f"kept must be >= 0, got {kept}")
    if image_size < 8:
        raise BenchError(f"image_size must be at least 8, got {image_size}")
    default_images, default_epochs = default_training(image_size)
    train_images = default_images if train_images is None else train_images
    epochs = default_epochs if epochs is None else epochs
    if train_images < 1 or epochs < 1:
        raise BenchError("train_images and epochs must be at least 1")
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="fedge-bench-") as tmp:
        root = Path(tmp)
        model_path = root / "model.onnx"
        progress(
            f"training the inspection CNN at {image_size}x{image_size} ({train_images} images, "
            f"{epochs} epochs) and exporting it to ONNX"
        )
        model_info = build_model(
            model_path, epochs=epochs, train_images=train_images, seed=seed, image_size=image_size
        )
        model_info["onnx_bytes"] = model_path.stat().st_size
        progress(f"making {images} PNG images")
        pngs = png_images(images, seed + 100, image_size)
        agents: list[EdgeAgent] = []
        try:
            full = make_agent(root / "agent", model_path, image_size)
            agents.append(full)
            fresh = None
            if kept > 0:
                fresh = make_agent(root / "agent-kept-0", model_path, image_size)
                agents.append(fresh)
            assert full.model is not None
            spec = full.preprocess_for(full.model)
            session = raw_session(model_path)
            baseline = Baseline(session, spec)
            pool = [decode_for(data, spec) for data in pngs]
            # Same model, same inputs: the two must agree before we time them.
            check = full.score_many(pool[:batch_size])
            expected = [baseline.scores(data) for data in pngs[:batch_size]]
            agree = (
                np.allclose(c.scores, e, atol=1e-5) for c, e in zip(check, expected, strict=True)
            )
            if not all(agree):
                raise BenchError("the agent and the bare session disagree on the same images")
            inference_paths.fill(full, pngs, kept, progress)
            station = full.station.counts()
            single = _single(
                path,
                kept,
                full,
                fresh,
                baseline,
                pngs,
                root / "paths",
                rounds=rounds,
                per_round=per_round,
                progress=progress,
            )
            batched = _batched(full, session, pool, rounds, per_round, batch_size, progress)
            pending = full.store.backlog()["pending_records"]
        finally:
            for agent in agents:
                agent.station.close()
                agent.store.close()
    return {
        "benchmark": "inference",
        **{key: single[key] for key in ("path", "kept", "ratio", "p99_ratio", "growth")},
        "met_target": single["met_target"],
        "single": single,
        "batched": batched,
        "station_before_timing": station,
        "images": images,
        "rounds": rounds,
        "per_round": per_round,
        "image_size": image_size,
        "image_shape": [image_size, image_size],
        "model": model_info,
        "providers": runtime.providers(),
        "predictions_persisted": pending,
        "measured": (
            "single: ms per image, p50/p99 over every image of every round, one image at a "
            "time through the path (library: agent.score_image on PNG bytes; api: POST "
            "/v1/score on a new connection, sent and timed by a camera process; inbox: "
            "a landed file's inotify event read, the file scored, committed and moved; "
            "inbox-scan: the same through the watcher's two scans; for both, `arrival`: "
            "a file's wait from its rename into the inbox to its move to done/ through the "
            "agent's watch loop at its defaults, on events and on the scans alone) with "
            "the station keeping `kept` images, against the same decode + preprocess + "
            "session.run storing nothing (in process; behind a bare http.server endpoint "
            "for api); growth: the same path's p50 on a fresh "
            "station over the full one's. batched: median over rounds of ms per image, "
            "agent.score_many on batches of batch_size vs session.run on the same batches "
            "pre-stacked. Same SessionOptions (1 intra-op thread) and providers."
        ),
        "machine": machine,
    }


def _batched(
    agent: EdgeAgent,
    session: ort.InferenceSession,
    pool: list[np.ndarray],
    rounds: int,
    per_round: int,
    batch_size: int,
    progress: Progress,
) -> dict[str, Any]:
    """The batched measurement (one model call and one commit per batch)."""
    assert agent.model is not None
    input_name, output_name = agent.model.input_name, agent.model.output_name
    shaped = [img.reshape(1, *img.shape) for img in pool]

    def picks(r: int) -> list[int]:
        return [(r * per_round + i) % len(pool) for i in range(per_round)]

    def chunks(r: int) -> list[list[int]]:
        chosen = picks(r)
        return [chosen[i : i + batch_size] for i in range(0, len(chosen), batch_size)]

    stacked = {
        r: [np.concatenate([shaped[i] for i in chunk]) for chunk in chunks(r)]
        for r in range(rounds)
    }
    commits_before = agent.scorer.commits.groups
    batched = _interleaved(
        rounds,
        progress,
        f"batches of {batch_size}",
        lambda r: _time_agent_batched(agent, [[pool[i] for i in c] for c in chunks(r)]),
        lambda r: _time_raw_batched(session, stacked[r], input_name, output_name),
    )
    return {
        "batch_size": batch_size,
        **_summary(*batched),
        "commits": agent.scorer.commits.groups - commits_before,
        "batches": rounds * len(range(0, per_round, batch_size)),
    }

"""``fedge bench gpu``: the station's inference and training on a GPU against its CPU (issue 25).

What a station with an NVIDIA GPU gets from it, on the paths the station uses:

- **inference**: the inspection CNN exported to ONNX as the registry publishes it, loaded
  with the execution providers the agent chooses
  (:func:`fedge.edge_agent.inference.runtime.providers`:
  CUDA when this ONNX Runtime build offers it, CPU last), against a CPU-only session of the
  same file, same threads; batched (32 images) and one image per call. The JSON says which
  provider ran: a CPU-only ONNX Runtime build (the ``onnxruntime`` wheel, not
  ``onnxruntime-gpu``) runs on the CPU even on a GPU machine, and that is reported, not
  hidden.
- **training**: one round of the station trainer (:func:`fedge.party.trainer.train`,
  Adam, the round's epochs and batch size) on the device it picks (CUDA when torch sees
  one) against the same round forced onto the CPU, same data, same seed.

Run where there is no GPU, it exits with a clear message and writes nothing. Timings are
medians over repeats after a warm-up; both sides run in the same process, back to back.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from fedge.bench.errors import BenchError
from fedge.models.inspection import IMAGE_SIZE, export_onnx, new_model
from fedge.party import trainer

CUDA_PROVIDER = "CUDAExecutionProvider"


def _machine() -> dict[str, Any]:
    try:
        from fedge.bench.machine import machine_info

        return machine_info()
    except ImportError:  # a GPU box with only what inference and training need
        return {"hostname": platform.node(), "platform": platform.platform()}


def _session(path: Path, providers: list[str], threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=providers)


def _ms_per_image(
    session: ort.InferenceSession, images: np.ndarray, batch: int, repeats: int
) -> float:
    """Median over ``repeats`` passes of milliseconds per image, ``batch`` per call."""
    name = session.get_inputs()[0].name
    session.run(None, {name: images[:batch]})  # warm-up: allocations, kernel choice
    passes = []
    for _ in range(repeats):
        started = time.perf_counter()
        for start in range(0, len(images), batch):
            session.run(None, {name: images[start : start + batch]})
        passes.append((time.perf_counter() - started) * 1000 / len(images))
    return statistics.median(passes)


def _train_seconds(
    examples: trainer.Examples, settings: trainer.TrainSettings, on: str, repeats: int
) -> float:
    """Median seconds of one training round on ``on`` ("cuda" or "cpu")."""
    times = []
    for attempt in range(repeats + 1):
        model = new_model(seed=attempt)
        result = trainer.train(model, examples, settings, on=torch.device(on))
        if on == "cuda":
            torch.cuda.synchronize()
        if attempt:  # the first is a warm-up (CUDA context, cuDNN autotuning)
            times.append(result.seconds)
    return statistics.median(times)


def run_gpu_check(
    *,
    images: int = 1024,
    train_images: int = 2000,
    epochs: int = 2,
    batch_size: int = 32,
    threads: int = 1,
    repeats: int = 5,
) -> dict[str, Any]:
    """Inference and one training round, GPU against CPU; raises BenchError without a GPU."""
    available = ort.get_available_providers()
    cuda_torch = torch.cuda.is_available()
    if not cuda_torch and CUDA_PROVIDER not in available:
        raise BenchError(
            "no GPU here: torch sees no CUDA device and ONNX Runtime offers no CUDA "
            f"provider (it offers {', '.join(available)}); run `fedge bench gpu` on a "
            "station with an NVIDIA GPU, its driver, a CUDA build of torch and "
            "onnxruntime-gpu"
        )
    from fedge.edge_agent.inference.runtime import providers as agent_providers

    rng = np.random.default_rng(0)
    pixels = rng.random((images, 1, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "inspect.onnx"
        export_onnx(new_model(seed=0), path)
        chosen = agent_providers()
        gpu_session = _session(path, chosen, threads)
        cpu_session = _session(path, ["CPUExecutionProvider"], threads)
        used = gpu_session.get_providers()[0]
        inference: dict[str, Any] = {
            "providers_available": available,
            "providers_chosen": chosen,
            "provider_used": used,
            "cuda_provider_available": CUDA_PROVIDER in available,
            "threads": threads,
            "images": images,
        }
        for label, batch in (("batched", 32), ("single", 1)):
            agent_ms = _ms_per_image(gpu_session, pixels, batch, repeats)
            cpu_ms = _ms_per_image(cpu_session, pixels, batch, repeats)
            inference[label] = {
                "batch": batch,
                "agent_providers_ms_per_image": round(agent_ms, 4),
                "cpu_ms_per_image": round(cpu_ms, 4),
                "cpu_over_agent": round(cpu_ms / agent_ms, 3),
            }
    training: dict[str, Any] = {"cuda_available": cuda_torch}
    if cuda_torch:
        x = rng.random((train_images, 1, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
        y = rng.integers(0, 2, train_images).astype(np.int64)
        examples = trainer.Examples(x, y)
        settings = trainer.TrainSettings(
            epochs=epochs, batch_size=batch_size, threads=threads, max_seconds=3600.0
        )
        gpu_s = _train_seconds(examples, settings, "cuda", repeats=max(1, repeats // 2))
        cpu_s = _train_seconds(examples, settings, "cpu", repeats=max(1, repeats // 2))
        training.update(
            {
                "device": torch.cuda.get_device_name(0),
                "examples": train_images,
                "epochs": epochs,
                "batch_size": batch_size,
                "gpu_seconds_per_round": round(gpu_s, 3),
                "cpu_seconds_per_round": round(cpu_s, 3),
                "cpu_over_gpu": round(cpu_s / gpu_s, 2),
            }
        )
    return {
        "benchmark": "gpu",
        "machine": _machine(),
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
        "inference": inference,
        "training": training,
        "method": (
            "same ONNX file and threads: the agent's provider choice vs CPUExecutionProvider, "
            "median ms per image over repeats after a warm-up; one station training round "
            "(party.trainer.train) on cuda vs cpu, same data and seed, median after a warm-up"
        ),
    }


if __name__ == "__main__":  # `python -m fedge.bench.gpu` where the CLI's extras are absent
    import json
    import sys

    try:
        print(json.dumps(run_gpu_check(), indent=2))
    except BenchError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(2)

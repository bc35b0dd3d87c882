"""Benchmarks of the fleet control plane, run with real components (``fedge bench ...``).

Each benchmark is a library function returning a JSON-ready dict that names the machine
it ran on (:mod:`fedge.bench.machine`); the CLI in :mod:`fedge.cli.bench` only parses
options, calls it and prints. Numbers measured so far are in BENCHMARKS.md.

- :mod:`fedge.bench.config_push`: signed threshold push to N edges until the manager
  stores every edge's report (edges simulated by :mod:`fedge.bench.config_push_worker`).
- :mod:`fedge.bench.ingest`: telemetry batches into the manager's store, exactly once
  (publishers in :mod:`fedge.bench.ingest_publisher`).
- :mod:`fedge.bench.inference`: the agent's scoring path against a bare ONNX Runtime loop.
- :mod:`fedge.bench.footprint`: an inference-only agent's RSS and imports, and the size
  of the ``fedge[agent]`` install.
- :mod:`fedge.bench.chaos`: faults injected into a live fleet of real processes, and
  the exactly-once, convergence and liveness invariants checked after it healed.
- :mod:`fedge.bench.anomaly`: anomaly detection from good parts: unseen-defect AUROC,
  federated vs pooled statistics, the smallest station's gain, serving cost.
"""

from collections.abc import Callable

Progress = Callable[[str], None]
"""Receives a short human line about what a benchmark is doing (the CLI shows it)."""


def no_progress(_: str) -> None:
    return None

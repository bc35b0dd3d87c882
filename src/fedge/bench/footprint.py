"""Footprint of an inference-only station: the agent's memory, imports and install size.

A real ``fedge agent run`` process (the ``fedge`` command of this environment) runs
against a throw-away control plane (:class:`~fedge.bench.testbed.Testbed`: Mosquitto, the
manager service, one enrolled edge). The manager publishes and deploys a small ONNX
classifier; once the agent serves it, ``images`` PNGs are scored through the agent's
local HTTP API and the predictions are awaited in the manager's store. Then:

- ``agent_rss_mb``: the agent's ``VmRSS`` (``/proc/PID/status``) after scoring, and
  ``agent_peak_rss_mb`` its ``VmHWM`` (peak);
- ``imports_torch`` / ``imports_flwr``: whether either module is loaded in the agent
  process (its ``GET /v1/status`` reports ``imported``);
- ``install_mb``: the bytes on disk of the distributions ``pip install 'fedge[agent]'``
  installs -- fedge's dependency closure without extras (``agent`` adds none), read from
  the installed distributions' file lists with :mod:`importlib.metadata`. For
  comparison, ``agent_train_install_mb`` is the same for ``fedge[agent-train]`` (None
  when a distribution of that closure is not installed here).

Target: neither torch nor flwr loaded, and an RSS of at most 150 MB.
"""

import contextlib
import importlib.metadata
import io
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from PIL import Image

import fedge
from fedge.bench import Progress, no_progress
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError, Testbed, wait_until
from fedge.edge_manager.reports import store as report_store
from fedge.edge_manager.security.enrollment import agent_toml
from fedge.transport.ports import free_port

TARGET_RSS_MB = 150.0
MODEL = ("inspect", 1)
CLASSES = ("clean", "scratch")
IMAGE_SIZE = 32
MB = 2**20


# ---------------------------------------------------------------- install size


def dependency_closure(
    root: str, extras: Iterable[str] = ()
) -> tuple[dict[str, importlib.metadata.Distribution], list[str]]:
    """The installed distributions ``pip install 'ROOT[EXTRAS]'`` needs, and those missing.

    Requirements are read from each distribution's metadata; a requirement counts when
    its marker holds for this interpreter with no extra or with one of those requested of
    that distribution.
    """
    found: dict[str, importlib.metadata.Distribution] = {}
    missing: set[str] = set()
    visited: set[tuple[str, str]] = set()
    queue: list[tuple[str, frozenset[str]]] = [(root, frozenset(extras))]
    while queue:
        name, wanted = queue.pop()
        key = canonicalize_name(name)
        todo = {""} | set(wanted)
        todo -= {extra for dist_key, extra in visited if dist_key == key}
        if not todo:
            continue
        visited.update((key, extra) for extra in todo)
        try:
            dist = found.get(key) or importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.add(key)
            continue
        found[key] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in todo):
                queue.append((requirement.name, frozenset(requirement.extras)))
    return found, sorted(missing)


def distribution_bytes(dist: importlib.metadata.Distribution) -> int:
    """Bytes on disk of the files a distribution installed (its RECORD).

    An editable install records no sources, so for fedge installed that way the package
    directory itself is counted (what a wheel install would put in site-packages).
    """
    paths = {path.resolve() for path in (Path(str(f.locate())) for f in dist.files or [])}
    if canonicalize_name(dist.metadata["Name"]) == "fedge":
        package_dir = Path(fedge.__file__).resolve().parent
        if package_dir / "__init__.py" not in paths:
            paths.update(p for p in package_dir.rglob("*") if "__pycache__" not in p.parts)
    return sum(path.stat().st_size for path in paths if path.is_file())


def install_size(extras: Iterable[str] = ()) -> dict[str, Any]:
    """``{"mb", "distributions": {name: mb}, "missing"}`` of ``fedge[EXTRAS]``."""
    found, missing = dependency_closure("fedge", extras)
    sizes = {name: distribution_bytes(dist) for name, dist in sorted(found.items())}
    return {
        "mb": round(sum(sizes.values()) / MB, 1),
        "distributions": {name: round(size / MB, 2) for name, size in sizes.items()},
        "missing": missing,
    }


# ---------------------------------------------------------------- the agent process


def fedge_command() -> list[str]:
    """This environment's ``fedge`` command (what a station's service runs)."""
    script = Path(sys.executable).parent / "fedge"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from fedge.cli.main import app; app()"]


def proc_status_mb(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` of a live process, in MiB (the kernel reports kB)."""
    values: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _http(url: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(
        url, data=data, headers=headers or {}, method="GET" if data is None else "POST"
    )
    with urllib.request.urlopen(request, timeout=10.0) as response:
        return json.loads(response.read())


class AgentProcess:
    """``fedge agent run --config CONFIG`` with its output in a log file."""

    def __init__(
        self, config: Path, http_port: int, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.http_port = http_port
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [*fedge_command(), "agent", "run", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,  # None: this process's environment
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def status(self) -> dict[str, Any]:
        if self.process.poll() is not None:
            raise BenchError(f"the agent exited ({self.process.returncode}): {self.log_tail()}")
        status: dict[str, Any] = _http(f"http://127.0.0.1:{self.http_port}/v1/status")
        return status

    def score(self, png: bytes, source: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.http_port}/v1/score"
        try:
            record: dict[str, Any] = _http(
                url, png, {"Content-Type": "image/png", "X-Source": source}
            )
        except urllib.error.HTTPError as exc:
            raise BenchError(f"the agent refused to score {source}: {exc.read()!r}") from None
        return record

    def wait_status(self, what: str, timeout_s: float, key: str, value: object) -> None:
        def holds() -> bool:
            with contextlib.suppress(OSError):
                return bool(self.status().get(key) == value)
            return False

        try:
            wait_until(holds, timeout_s, what, interval_s=0.05)
        except BenchError as exc:
            raise BenchError(f"{exc}; agent log: {self.log_tail()}") from None

    def log_tail(self, limit: int = 800) -> str:
        try:
            return self.log_path.read_text(errors="replace").strip()[-limit:] or "no output"
        except OSError:
            return "no log"

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# ---------------------------------------------------------------- the benchmark


def run_footprint(
    images: int = 200, *, timeout_s: float = 60.0, seed: int = 0, progress: Progress = no_progress
) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result (see the module docstring)."""
    if images < 1:
        raise BenchError(f"images must be at least 1, got {images}")
    from fedge.models.tiny_onnx import build_linear_classifier  # needs onnx: the bench side

    machine = machine_info()
    with Testbed(1, progress=progress) as bed:
        edge = bed.edges[0]
        http_port = free_port()
        config = bed.root / "station" / "agent.toml"
        config.parent.mkdir()
        toml = agent_toml(bed.home, edge, config.parent / "data", password=bed.passwords[edge])
        lines = [line for line in toml.splitlines() if not line.startswith("http_port")]
        config.write_text("\n".join([*lines, f"http_port = {http_port}", ""]))
        config.chmod(0o600)
        bed.start_broker()
        bed.start_service()
        progress("starting the agent")
        agent = AgentProcess(config, http_port, bed.root / "agent.log")
        try:
            agent.wait_status("the agent to connect", timeout_s, "connected", True)
            name, version = MODEL
            model_path = build_linear_classifier(
                bed.root / "model.onnx", size=IMAGE_SIZE, seed=seed
            )
            bed.fleet.registry.publish(
                model_path,
                name=name,
                version=version,
                classes=CLASSES,
                positive_classes=("scratch",),
            )
            progress(f"deploying {name}:{version}")
            bed.fleet.deploy(name, version, [edge])
            agent.wait_status(
                "the deployment to be served", timeout_s, "serving", f"{name}:{version}"
            )
            progress(f"scoring {images} images")
            rng = np.random.default_rng(seed)
            for i in range(images):
                pixels = (rng.random((IMAGE_SIZE, IMAGE_SIZE)) * 255).astype(np.uint8)
                agent.score(_png(pixels), source=f"bench-{i:05d}")
            wait_until(
                lambda: report_store.prediction_count(bed.reader(), edge=edge) == images,
                timeout_s,
                f"the manager to store the {images} predictions",
                interval_s=0.05,
            )
            memory = proc_status_mb(agent.pid)
            imported = agent.status()["imported"]
        finally:
            agent.stop()
    progress("measuring the install size")
    agent_install = install_size(["agent"])
    train_install = install_size(["agent-train"])
    rss = round(memory["VmRSS"], 1)
    imports_torch, imports_flwr = bool(imported["torch"]), bool(imported["flwr"])
    return {
        "benchmark": "agent-footprint",
        "machine": machine,
        "agent_rss_mb": rss,
        "agent_peak_rss_mb": round(memory["VmHWM"], 1),
        "imports_torch": imports_torch,
        "imports_flwr": imports_flwr,
        "install_mb": agent_install["mb"],
        "install_distributions_mb": agent_install["distributions"],
        "install_missing": agent_install["missing"],
        "agent_train_install_mb": None if train_install["missing"] else train_install["mb"],
        "agent_train_install_missing": train_install["missing"],
        "images_scored": images,
        "model": f"{MODEL[0]}:{MODEL[1]} (linear classifier, {IMAGE_SIZE}x{IMAGE_SIZE})",
        "target_rss_mb": TARGET_RSS_MB,
        "met_target": rss <= TARGET_RSS_MB and not imports_torch and not imports_flwr,
    }

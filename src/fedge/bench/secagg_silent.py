"""A SecAgg+ round in which a SuperNode is SIGKILLed mid-round, on real processes (issue 25).

The party that "dies" in the simulation benchmark sends an error reply; a station that
loses power sends nothing at all. This runs that case: fedge's SuperLink (the
``flower-superlink`` process behind its front, plain HTTP), ``parties`` real
``flower-supernode`` processes running the SecAgg+ benchmark's ClientApp
(:mod:`fedge.bench.secagg_apps`), and the ServerApp of
:mod:`fedge.bench.secagg_silent_server` submitted with ``flwr run``. In its second round
partition ``dropped`` takes part in the key stages, writes ``silent-<partition>`` into the
signal directory before it would send its masked vector, and hangs; this harness then
SIGKILLs its SuperNode and every process under it (the SuperExec and the ClientApp).

Why the round still ends, and when: the SuperLink reports a dead node only once its
heartbeat expires (37.5-60 s after the death, Flower 1.41), so the masked-vector stage
waits on our own clock, at most ``collect_timeout_s`` (plus one pull,
:class:`fedge.aggregator.rounds.collect.PolledGrid`); the unmask stage no longer asks the
dead node. The stated bound on the silent round is :func:`round_bound_s`: the clean
round's key stages (setup, share keys, unmask: they do not wait for the dead node) with a
margin, plus the masked-vector stage's limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.aggregator.superlink.link import SuperLink
from fedge.bench import Progress, no_progress
from fedge.bench.errors import BenchError
from fedge.bench.secagg_apps import PARTITION_ID, SIGNAL_DIR, SILENT
from fedge.bench.testbed import flwr_run
from fedge.edge_agent.training.supervisor import kill_tree
from fedge.transport.ports import free_port

DROPPED = 1
RUN_WAIT_S = 900.0
# What the key stages may take beyond the clean round's (each stage starts a ClientApp
# process per party and waits for a SuperNode's 3 s idle poll): a factor and a floor.
KEY_STAGE_MARGIN = 2.0
KEY_STAGE_SLACK_S = 10.0
TIMEOUT_REASON = "SecAgg+ collect_masked_vectors stage: no answer within"


@dataclass(frozen=True)
class SilentSettings:
    parties: int = 5
    params: int = 100_000
    seed: int = 0
    collect_timeout_s: float = 30.0
    """The masked-vector stage's limit: shorter than Flower's 37.5 s earliest heartbeat
    expiry, so only our clock can end the wait for the dead node."""
    key_stage_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.parties < 4:
            raise ValueError(
                f"the silent round needs >= 4 SuperNodes (one is killed, SecAgg+ never "
                f"unmasks fewer than 3), got {self.parties}"
            )
        if self.params < 2:
            raise ValueError(f"params must be >= 2, got {self.params}")
        if not 0 < self.collect_timeout_s < self.key_stage_timeout_s:
            raise ValueError(
                "collect_timeout_s must be > 0 and below key_stage_timeout_s, got "
                f"{self.collect_timeout_s} and {self.key_stage_timeout_s}"
            )


def round_bound_s(clean_stages_s: dict[str, float], collect_timeout_s: float) -> float:
    """The silent round's stated bound: the masked-vector stage's limit plus the clean
    round's other stages, each allowed ``KEY_STAGE_MARGIN`` times its time (a busy machine
    starts processes slower) plus ``KEY_STAGE_SLACK_S`` in all."""
    others = sum(s for stage, s in clean_stages_s.items() if stage != "collect_masked_vectors")
    return collect_timeout_s + KEY_STAGE_MARGIN * others + KEY_STAGE_SLACK_S


def silent_verdict(result: dict[str, Any], settings: SilentSettings) -> dict[str, Any]:
    """The benchmark's figures from :func:`run_silent_dropout`'s result (pure).

    Survived (1) when the dropped node was killed, the round ended with every other party
    on time and the dropped one failed for *our* timeout (not Flower's "node unavailable"),
    the unmasked model is within the quantisation bound of the survivors' weighted mean,
    and the round took no longer than :func:`round_bound_s`.
    """
    bound_s = round_bound_s(result["clean_stages_s"], settings.collect_timeout_s)
    survivors = [p for p in range(settings.parties) if p != DROPPED]
    reason = str(result["failures"].get(str(DROPPED), ""))
    survived = (
        bool(result.get("killed"))
        and result["failed"] == [DROPPED]
        and sorted(result["on_time"]) == survivors
        and reason.startswith(f"{TIMEOUT_REASON} {settings.collect_timeout_s} s")
        and result["max_abs_error"] <= result["error_bound"]
        and result["silent_round_s"] <= bound_s
    )
    clean_s = float(result["clean_round_s"])
    return {
        "silent_dropouts_survived": int(survived),
        "silent_round_s": round(float(result["silent_round_s"]), 3),
        "silent_round_bound_s": round(bound_s, 3),
        "silent_clean_round_s": round(clean_s, 3),
        "silent_ratio": round(float(result["silent_round_s"]) / clean_s, 3) if clean_s else None,
        "silent_collect_timeout_s": settings.collect_timeout_s,
        "silent_collect_waited_s": round(
            float(result["silent_stages_s"].get("collect_masked_vectors", 0.0)), 3
        ),
        "silent_max_abs_error": result["max_abs_error"],
        "silent_error_bound": result["error_bound"],
        "silent_dropout_reason": reason,
        "silent_stages_s": {k: round(v, 3) for k, v in result["silent_stages_s"].items()},
        "silent_clean_stages_s": {k: round(v, 3) for k, v in result["clean_stages_s"].items()},
        "silent_parties": settings.parties,
        "silent_params": settings.params,
    }


def run_silent_dropout(
    root: Path, settings: SilentSettings, progress: Progress = no_progress
) -> dict[str, Any]:
    """Run the two rounds under ``root``; the ServerApp's result plus the kill's timing."""
    root.mkdir(parents=True, exist_ok=True)
    signals = root / "signals"
    signals.mkdir(exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    superlink = SuperLink(root / "superlink", "127.0.0.1", free_port())
    nodes: dict[int, subprocess.Popen[bytes]] = {}
    out = root / "result.json"
    try:
        progress("starting a SuperLink and SuperNodes")
        superlink.start()
        for partition in range(settings.parties):
            nodes[partition] = _supernode(root, partition, superlink.address, signals)
        progress("flwr run: a clean SecAgg+ round, then one with a node SIGKILLed")
        _flwr_run(root, settings, superlink.local_address, out)
        killed_at, kill_lag_s = _kill_when_silent(nodes, signals, out, superlink, root)
    finally:
        for proc in nodes.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait(timeout=30)
        superlink.stop()
    result: dict[str, Any] = json.loads(out.read_text())
    if "error" in result:
        raise BenchError(f"the silent-round ServerApp failed: {result['error']}\n{_logs(root)}")
    result["killed"] = killed_at is not None
    result["kill_lag_s"] = kill_lag_s
    return result


def _supernode(
    root: Path, partition: int, superlink: str, signals: Path
) -> subprocess.Popen[bytes]:
    home = root / "homes" / f"node-{partition}"
    home.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.5",
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    config = f'{PARTITION_ID}={partition} {SIGNAL_DIR}="{signals}"'
    with open(root / "logs" / f"node-{partition}.log", "ab") as log:
        return subprocess.Popen(
            [
                str(bin_dir / "flower-supernode"), "--insecure", "--superlink", superlink,
                "--port", str(free_port()), "--node-config", config,
            ],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )  # fmt: skip


def _flwr_run(root: Path, settings: SilentSettings, superlink: str, out: Path) -> None:
    app = root / "app"
    app.mkdir(exist_ok=True)
    (app / "pyproject.toml").write_text(
        "\n".join(
            [
                "[build-system]",
                'requires = ["hatchling"]',
                'build-backend = "hatchling.build"',
                "[project]",
                'name = "secagg-silent"',
                'version = "1.0.0"',
                'license = "Apache-2.0"',
                "dependencies = []",
                "[tool.flwr.app]",
                'publisher = "bench"',
                "[tool.flwr.app.components]",
                'serverapp = "fedge.bench.secagg_silent_server:silent_server"',
                'clientapp = "fedge.bench.secagg_apps:secagg_app"',
                "[tool.flwr.app.config]",
                f"parties = {settings.parties}",
                f"params = {settings.params}",
                f"dropped = {DROPPED}",
                f"seed = {settings.seed}",
                f"collect-timeout-s = {settings.collect_timeout_s}",
                f"key-stage-timeout-s = {settings.key_stage_timeout_s}",
                f"out = {json.dumps(str(out))}",
                "",
            ]
        )
    )
    flwr_run(app, superlink, root / "cli", "the SecAgg+ rounds")


def _kill_when_silent(
    nodes: dict[int, subprocess.Popen[bytes]],
    signals: Path,
    out: Path,
    superlink: SuperLink,
    root: Path,
) -> tuple[float | None, float | None]:
    """SIGKILL the dropped partition's SuperNode tree once its ClientApp says it hangs;
    return when (wall clock) and how long after the signal file appeared, once the
    ServerApp's result is written."""
    marker = signals / f"{SILENT}-{DROPPED}"
    killed_at: float | None = None
    lag_s: float | None = None
    end = time.monotonic() + RUN_WAIT_S
    while not out.exists():
        if killed_at is None and marker.exists():
            seen = time.monotonic()
            kill_tree(nodes[DROPPED].pid)
            nodes[DROPPED].wait(timeout=30)
            killed_at, lag_s = time.time(), time.monotonic() - seen
        if not superlink.running:
            raise BenchError(f"the SuperLink exited mid-run\n{_logs(root)}")
        if time.monotonic() >= end:
            raise BenchError(f"no result within {RUN_WAIT_S:.0f} s\n{_logs(root)}")
        time.sleep(0.05)
    return killed_at, lag_s


def _logs(root: Path) -> str:
    parts = []
    for path in [*sorted((root / "logs").glob("*.log")), root / "superlink" / "superlink.log"]:
        if path.exists():
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)

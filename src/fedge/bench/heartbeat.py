"""``fedge bench heartbeat``: what liveness within seconds costs the broker and the manager
at fleet scale (issue 27, item 6).

Agents repeat their birth every ``heartbeat_s`` (2.5 s, QoS 0) and serve's silence sweep
marks a station silent for ``edge_lost_after_s`` (7 s) lost (edge_manager/fleet/liveness.py).
This measures that design against the one before it, side by side on fresh testbeds:

- **heartbeats on**: ``edges`` stations connected to a real Mosquitto (one MQTT session
  each, the agent's transport and 30 s keepalive, spread over ``workers`` processes of
  :mod:`fedge.bench.heartbeat_publisher`), each sending its birth every ``heartbeat_s``;
  :class:`ManagerService` in this process with the sweep on (``edge_lost_after_s``);
- **heartbeats off** (the peer): the same stations connected and silent but for their
  keepalive, the sweep off (``edge_lost_after_s = 0``): the fleet whose loss only the
  broker's will says, 45 s after a cut.

Set-up (not measured): enrolment, every station stored online in session 1, the broker,
serve, the connections, then ``settle_s`` of running. Measured over ``phase_s``: the CPU
seconds Mosquitto used (``utime + stime`` of ``/proc/<pid>/stat``) and this process used
(serve's threads: its MQTT loop, ingest writer and sweep; the bench's own threads only
wait meanwhile), both as a share of one core, and the liveness messages serve stored per
second. The ratios are on / off. Then, heartbeats on only: ``cut`` stations stop beating
(their link cut, as far as the manager can tell) and the bench polls the store until each
is ``lost``: ``loss_visible_s`` is from a station's last heartbeat to the poll that saw it
lost (target: 10 s). A station marked lost while still beating fails the run.
"""

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from fedge.bench import Progress, no_progress
from fedge.bench.heartbeat_publisher import SESSION, HeartbeatSpec
from fedge.bench.machine import machine_info
from fedge.bench.testbed import BenchError, HelperProcess, Testbed
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.fleet.liveness import SWEEP_EVERY_S
from fedge.edge_manager.ingest.store import IngestTransaction
from fedge.protocols.liveness import EdgeState, Liveness

PUBLISHER_MODULE = "fedge.bench.heartbeat_publisher"
TARGET_LOSS_VISIBLE_S = 10.0
POLL_S = 0.1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of a process so far (fields 14 and 15 of its stat)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def run_heartbeat(
    edges: int = 1000,
    *,
    heartbeat_s: float = 2.5,
    lost_after_s: float = 7.0,
    phase_s: float = 60.0,
    settle_s: float = 5.0,
    workers: int = 4,
    cut: int = 10,
    timeout_s: float = 120.0,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    if edges < 1 or workers < 1 or not 0 <= cut <= edges:
        raise BenchError("need edges >= 1, workers >= 1 and 0 <= cut <= edges")
    if heartbeat_s <= 0 or lost_after_s < 3 or phase_s <= 0:
        raise BenchError("need heartbeat_s > 0, lost_after_s >= 3 and phase_s > 0")
    machine = machine_info()
    sides: dict[str, dict[str, Any]] = {}
    for name, beat in (("off", 0.0), ("on", heartbeat_s)):

        def step(line: str, name: str = name) -> None:
            progress(f"heartbeats {name}: {line}")

        sides[name] = _one_side(
            edges,
            beat,
            lost_after_s if beat else 0.0,
            phase_s=phase_s,
            settle_s=settle_s,
            workers=min(workers, edges),
            cut=cut if beat else 0,
            timeout_s=timeout_s,
            progress=step,
        )
    on, off = sides["on"], sides["off"]
    visible = on["loss_visible_s"]
    worst = max(visible) if visible else None
    return {
        "benchmark": "heartbeat",
        "edges": edges,
        "heartbeat_s": heartbeat_s,
        "edge_lost_after_s": lost_after_s,
        "messages_per_s": on["liveness_per_s"],
        "broker_cpu_pct": on["broker_cpu_pct"],
        "broker_cpu_pct_without": off["broker_cpu_pct"],
        "broker_cpu_ratio": _ratio(on["broker_cpu_pct"], off["broker_cpu_pct"]),
        "manager_cpu_pct": on["manager_cpu_pct"],
        "manager_cpu_pct_without": off["manager_cpu_pct"],
        "manager_cpu_ratio": _ratio(on["manager_cpu_pct"], off["manager_cpu_pct"]),
        "loss_visible_s_max": worst,
        "loss_visible_s_median": round(statistics.median(visible), 2) if visible else None,
        "met_target": worst is not None
        and worst <= TARGET_LOSS_VISIBLE_S
        and on["lost_while_beating"] == 0,
        "target": {"loss_visible_s": TARGET_LOSS_VISIBLE_S},
        "settings": {
            "phase_s": phase_s,
            "settle_s": settle_s,
            "workers": workers,
            "cut": cut,
            "keepalive_s": 30,
            "sweep_every_s": SWEEP_EVERY_S,
            "transport": "plain TCP, a password per station",
        },
        "sides": sides,
        "measured": (
            "CPU: utime+stime from /proc/<pid>/stat over phase_s, as % of one core, of "
            "mosquitto and of the process running manager serve's ManagerService; "
            "messages_per_s: liveness messages serve stored per second over the phase; "
            "on = births every heartbeat_s + silence sweep, off = connected, keepalive only, "
            "no sweep; loss_visible_s: a cut station's last heartbeat -> its store row lost"
        ),
        "machine": machine,
    }


def _ratio(value: float, baseline: float) -> float | None:
    return round(value / baseline, 2) if baseline > 0 else None


def _one_side(
    edges: int,
    heartbeat_s: float,
    lost_after_s: float,
    *,
    phase_s: float,
    settle_s: float,
    workers: int,
    cut: int,
    timeout_s: float,
    progress: Progress,
) -> dict[str, Any]:
    with Testbed(edges, progress=progress) as bed:
        bed.home.save_settings(
            dataclasses.replace(bed.settings, metrics_port=0, edge_lost_after_s=lost_after_s)
        )
        bed.start_broker()
        service = bed.start_service()
        assert bed.broker is not None
        broker_pid = int(bed.broker.pid_path.read_text().strip())
        helpers: list[HelperProcess] = []
        try:
            progress(f"connecting {edges} stations from {workers} processes")
            for index in range(workers):
                spec = HeartbeatSpec(
                    host=bed.broker.host,
                    port=bed.broker.port,
                    fleet=bed.settings.fleet,
                    edges=[bed.logins[edge] for edge in bed.edges[index::workers]],
                    heartbeat_s=heartbeat_s,
                )
                helpers.append(
                    HelperProcess(
                        PUBLISHER_MODULE, spec.to_json(), bed.root / f"stations-{index}.log"
                    )
                )
            for helper in helpers:
                helper.wait_event("ready", timeout_s)
            for helper in helpers:
                helper.send('{"cmd": "go"}')
            for helper in helpers:
                helper.wait_event("beating", timeout_s)
            # Stored online now, not before the connections (which take seconds at 1,000
            # stations): else the sweep would find them silent before their first beat.
            _all_online(bed)
            time.sleep(settle_s)  # serve past its own start-up grace; beats steady
            progress(f"measuring {phase_s:.0f} s")
            # The ingestor counts what it stored by kind; serve counts the sweep's marks.
            stored_by_kind, counters = service.ingestor.counters, service.counters
            stored0 = stored_by_kind["stored.liveness"]
            lost0 = counters["liveness.silent_lost"]
            broker0, manager0, wall0 = cpu_seconds(broker_pid), cpu_seconds("self"), time.time()
            time.sleep(phase_s)
            broker1, manager1, wall1 = cpu_seconds(broker_pid), cpu_seconds("self"), time.time()
            stored = stored_by_kind["stored.liveness"] - stored0
            lost_while_beating = counters["liveness.silent_lost"] - lost0
            seconds = wall1 - wall0
            visible = _cut_and_watch(bed, helpers, cut, timeout_s, progress) if cut else []
        finally:
            for helper in helpers:
                helper.stop()
        sent = sum(int((h.find("stopped") or {}).get("sent", 0)) for h in helpers)
        errors = [e for h in helpers for e in h.errors()]
    if errors:
        raise BenchError(f"station processes failed: {errors[:3]}")
    return {
        "heartbeat_s": heartbeat_s,
        "edge_lost_after_s": lost_after_s,
        "seconds": round(seconds, 2),
        "broker_cpu_pct": round(100.0 * (broker1 - broker0) / seconds, 2),
        "manager_cpu_pct": round(100.0 * (manager1 - manager0) / seconds, 2),
        "liveness_stored": stored,
        "liveness_per_s": round(stored / seconds, 1),
        "heartbeats_sent": sent,
        "lost_while_beating": lost_while_beating,
        "loss_visible_s": visible,
    }


def _all_online(bed: Testbed) -> None:
    """Every station stored online in the session its heartbeats carry, as live ones are."""
    now = time.time()
    with IngestTransaction.open(bed.store) as tx:
        for edge in bed.edges:
            tx.went_online(edge, Liveness(edge, SESSION, EdgeState.ONLINE, "bench"), now)


def _cut_and_watch(
    bed: Testbed, helpers: list[HelperProcess], cut: int, timeout_s: float, progress: Progress
) -> list[float]:
    """Silence ``cut`` stations spread over the processes; seconds from each one's last
    heartbeat until the store says it is lost."""
    progress(f"cutting {cut} stations")
    chosen = bed.edges[:: max(1, len(bed.edges) // cut)][:cut]
    last_beat: dict[str, float] = {}
    for index, helper in enumerate(helpers):
        mine = [edge for edge in chosen if bed.edges.index(edge) % len(helpers) == index]
        if not mine:
            continue
        helper.send(json.dumps({"cmd": "silence", "edges": mine}))
        for edge, at in helper.wait_event("silenced", timeout_s)["last_beat"].items():
            if at is None:
                raise BenchError(f"{edge} had sent no heartbeat before its cut")
            last_beat[edge] = float(at)
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < len(chosen):
        if time.monotonic() > deadline:
            missing = sorted(set(chosen) - set(seen))
            raise BenchError(f"{missing} not lost within {timeout_s:.0f} s of their cut")
        now = time.time()
        for row in edge_store.summaries(bed.store):
            if row.edge in last_beat and row.state == "lost":
                seen.setdefault(row.edge, now)
        time.sleep(POLL_S)
    return [round(seen[edge] - last_beat[edge], 2) for edge in chosen]

"""The chaos harness's pure parts and its proxy: schedule, invariants, drop/stall/truncate."""

import dataclasses
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from fedge.bench.chaos.clock import clock_env, install_shim, set_offset
from fedge.bench.chaos.invariants import ControlObservation, EdgeObservation, check
from fedge.bench.chaos.proxy import FaultyProxy, ProxyMode
from fedge.bench.chaos.schedule import (
    AGENT_KINDS,
    BROKER,
    MANAGER,
    FaultKind,
    PlantShape,
    build_schedule,
)

SHAPE = PlantShape(edges=("c00", "c01", "c02"), disk_edges=("c00",))


# ---------------------------------------------------------------- schedule


def test_schedule_is_a_function_of_the_seed() -> None:
    assert build_schedule(7, 300, SHAPE) == build_schedule(7, 300, SHAPE)
    assert build_schedule(7, 300, SHAPE) != build_schedule(8, 300, SHAPE)


@pytest.mark.parametrize("seed", range(1, 6))
def test_five_minutes_hold_forty_faults_of_every_kind(seed: int) -> None:
    shape = PlantShape(tuple(f"c{i:02d}" for i in range(8)), ("c00", "c01"), manager_disk=True)
    schedule = build_schedule(seed, 300, shape)
    assert len(schedule) >= 40
    assert {f.kind for f in schedule} == set(FaultKind)


def test_faults_never_overlap_on_a_target_and_end_within_the_phase() -> None:
    schedule = build_schedule(3, 120, SHAPE)
    by_target: dict[str, list[tuple[float, float]]] = {}
    for fault in schedule:
        assert fault.at_s > 0 and fault.end_s <= 120
        by_target.setdefault(fault.target, []).append((fault.at_s, fault.end_s))
        if fault.kind in AGENT_KINDS:
            assert fault.target in SHAPE.edges
        if fault.kind is FaultKind.DISK_FULL:
            assert fault.target in SHAPE.disk_edges
        if fault.kind is FaultKind.MANAGER_KILL:
            assert fault.target == MANAGER
        if fault.kind in (FaultKind.BROKER_KILL, FaultKind.BROKER_RESTART):
            assert fault.target == BROKER
    for spans in by_target.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start > end


def test_no_disk_full_without_a_station_on_its_own_file_system() -> None:
    schedule = build_schedule(1, 300, PlantShape(("c00",), ()))
    assert FaultKind.DISK_FULL not in {f.kind for f in schedule}


def test_the_manager_disk_fills_only_on_its_own_file_system_and_never_while_killed() -> None:
    """manager_disk_full (issue 33) aims at the manager, like manager_kill: the two never
    overlap (a full store refuses `manager serve` at start)."""
    assert FaultKind.MANAGER_DISK_FULL not in {
        f.kind for f in build_schedule(1, 300, PlantShape(("c00",), ()))
    }
    shape = PlantShape(tuple(f"c{i:02d}" for i in range(8)), ("c00",), manager_disk=True)
    schedule = build_schedule(2, 300, shape)
    filled = [f for f in schedule if f.kind is FaultKind.MANAGER_DISK_FULL]
    assert filled and all(f.target == MANAGER for f in filled)
    on_manager = sorted((f.at_s, f.end_s) for f in schedule if f.target == MANAGER)
    for (_, end), (start, _) in itertools.pairwise(on_manager):
        assert start > end


# ---------------------------------------------------------------- invariants


def _edge(**changes: object) -> EdgeObservation:
    base = EdgeObservation(
        edge="c00",
        produced_predictions=frozenset({"p-1", "p-2"}),
        produced_labels=frozenset({"l-1"}),
        acked_predictions=frozenset({"p-1"}),
        acked_labels=frozenset({"l-1"}),
        dropped_files=frozenset({"c00-1.png"}),
        scored_sources={"file:c00-1.png": 1, "api:c00:1": 1},
        stored_predictions={"p-1": 1, "p-2": 1},
        stored_labels=frozenset({"l-1"}),
        open_gaps=0,
        desired_config=3,
        agent_config=3,
        manager_config=3,
        desired_model="inspect:2",
        agent_serving="inspect:2",
        manager_serving="inspect:2",
        responsive=True,
        backlog={"pending_records": 0, "outbox_batches": 0},
        batch_records=3,
        stored_rows=3,
        restore_failures=0,
        corruptions=0,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


HEALTHY = ControlObservation(manager_responsive=True, broker_running=True, rejections=0)


def test_a_clean_run_passes() -> None:
    verdict = check([_edge()], HEALTHY)
    assert verdict.passed
    assert (verdict.records_produced, verdict.records_stored) == (3, 3)


def test_lost_counts_missing_at_the_manager_acked_but_not_kept_and_unscored_files() -> None:
    verdict = check(
        [
            _edge(
                stored_predictions={"p-1": 1},
                stored_labels=frozenset(),
                acked_predictions=frozenset({"p-1", "p-9"}),
                scored_sources={},
            )
        ],
        HEALTHY,
    )
    assert verdict.lost == 4  # p-2 and l-1 not stored, p-9 not kept, the file not scored
    assert not verdict.passed


def test_duplicates_at_the_manager_and_rescored_files_count() -> None:
    verdict = check(
        [_edge(stored_predictions={"p-1": 3, "p-2": 1}, scored_sources={"file:c00-1.png": 2})],
        HEALTHY,
    )
    assert verdict.duplicated == 3


def test_convergence_needs_the_agent_and_the_manager_at_the_last_desired_state() -> None:
    assert check([_edge(manager_config=2)], HEALTHY).unconverged_edges == 1
    assert check([_edge(agent_serving="inspect:1")], HEALTHY).unconverged_edges == 1


def test_hung_counts_silent_agents_and_the_control_plane() -> None:
    silent = _edge(responsive=False, agent_config=None, agent_serving=None, backlog=None)
    control = ControlObservation(manager_responsive=False, broker_running=True, rejections=0)
    assert check([silent], control).hung_processes == 2


def test_counters_must_agree() -> None:
    verdict = check(
        [_edge(backlog={"pending_records": 1}, batch_records=4, restore_failures=1)],
        ControlObservation(manager_responsive=True, broker_running=True, rejections=2),
    )
    assert len(verdict.counter_issues) == 4
    assert check([_edge(restore_failures=1, corruptions=1)], HEALTHY).passed


# ---------------------------------------------------------------- proxy


@pytest.fixture
def echo_server() -> Iterator[int]:
    """A TCP server that echoes whatever it receives."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield int(listener.getsockname()[1])
    listener.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)


def _connect(proxy: FaultyProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=2.0)
    return sock


@pytest.mark.integration
def test_proxy_passes_drops_and_truncates(echo_server: int) -> None:
    proxy = FaultyProxy("127.0.0.1", echo_server).start()
    try:
        with _connect(proxy) as sock:
            sock.sendall(b"hello")
            assert sock.recv(100) == b"hello"
            proxy.set_mode(ProxyMode.DROP)
            assert sock.recv(100) == b""  # cut
        with _connect(proxy) as sock:
            assert sock.recv(100) == b""  # refused while dropping
        proxy.set_mode(ProxyMode.TRUNCATE)
        with _connect(proxy) as sock:
            sock.sendall(b"0123456789")
            # Half ("01234") went up and the link was cut. The echo may still have come
            # back through the down pump before the cut, then truncated too (e.g. "01"):
            # what arrives is a strict prefix of the half, never the whole message.
            received = b""
            while chunk := sock.recv(100):
                received += chunk
            assert b"01234".startswith(received) and len(received) < 5, received
        proxy.set_mode(ProxyMode.PASS)
        with _connect(proxy) as sock:
            sock.sendall(b"again")
            assert sock.recv(100) == b"again"
    finally:
        proxy.close()


@pytest.mark.integration
def test_proxy_stall_holds_bytes_until_it_flows_again(echo_server: int) -> None:
    proxy = FaultyProxy("127.0.0.1", echo_server).start()
    try:
        with _connect(proxy) as sock:
            proxy.set_mode(ProxyMode.STALL)
            sock.sendall(b"held")
            sock.settimeout(0.5)
            with pytest.raises(TimeoutError):
                sock.recv(100)
            proxy.set_mode(ProxyMode.PASS)
            sock.settimeout(5.0)
            assert sock.recv(100) == b"held"
    finally:
        proxy.close()


# ---------------------------------------------------------------- clock shim


@pytest.mark.integration
def test_clock_shim_steps_a_child_wall_clock(tmp_path: Path) -> None:
    offset_file = tmp_path / "clock_offset"
    set_offset(offset_file, 86400.0)
    env = clock_env(dict(os.environ), install_shim(tmp_path / "shim"), offset_file)
    probe = "import time; print(time.time())"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert float(out.stdout) - time.time() == pytest.approx(86400.0, abs=30.0)
    set_offset(offset_file, 0.0)
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert float(out.stdout) == pytest.approx(time.time(), abs=30.0)


def test_clock_jumps_carry_a_step_and_only_clock_jumps_do() -> None:
    schedule = build_schedule(4, 300, PlantShape(("c00", "c01"), ()))
    jumps = [f for f in schedule if f.kind is FaultKind.CLOCK_JUMP]
    assert jumps and all(600 <= abs(f.clock_offset_s) <= 2 * 86400 for f in jumps)
    assert all(f.clock_offset_s == 0 for f in schedule if f.kind is not FaultKind.CLOCK_JUMP)


# ---------------------------------------------------------------- the report (issue 25, item 7)


def _report(applied: list[Any], incidents: list[dict[str, Any]]) -> dict[str, Any]:
    from fedge.bench.chaos.injector import Injector, Watchdog
    from fedge.bench.chaos.load import OperatorLoad
    from fedge.bench.chaos.report import build_report

    injector = Injector(cast(Any, None), 0.0)
    injector.applied = applied
    watchdog = Watchdog(cast(Any, None), 0.0)
    watchdog.incidents = incidents
    operator = cast(OperatorLoad, SimpleNamespace(counters={}, errors=[]))
    return build_report(
        machine={},
        seed=1,
        agents=1,
        minutes=0.125,  # a target of one fault
        disk_agents=0,
        verdict=check([_edge()], HEALTHY),
        injector=injector,
        loads={},
        operator=operator,
        watchdog=watchdog,
        heal_s=0.0,
        pending=[],
        unexpected_exits=[],
        stop_timeouts=[],
        workdir=None,
    )


def _applied(kind: FaultKind, *, happened: bool = True, notes: tuple[str, ...] = ()) -> Any:
    from fedge.bench.chaos.injector import Applied
    from fedge.bench.chaos.schedule import Fault

    return Applied(Fault(kind, 1.0, "c00", 2.0), 1.0, 3.0, list(notes), happened)


def test_a_hang_the_watchdog_saw_mid_run_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedge.bench.chaos import report

    monkeypatch.setattr(report, "TARGET_KINDS", 1)
    faults = [_applied(FaultKind.AGENT_KILL)]
    assert _report(faults, [])["met_target"]
    hung = _report(faults, [{"edge": "c00", "at_s": 12.0, "error": "TimeoutError"}])
    assert hung["hang_incidents"] == 1 and not hung["met_target"]


def test_a_fault_counts_only_when_it_happened(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedge.bench.chaos import report

    monkeypatch.setattr(report, "TARGET_KINDS", 1)
    no_model = _applied(FaultKind.MODEL_CORRUPT, happened=False)
    failed = _applied(FaultKind.AGENT_KILL, notes=("begin failed: OSError: x",))
    data = _report([no_model, failed], [])
    assert data["faults_injected"] == 0 and data["faults_by_kind"] == {}
    assert not data["met_target"]  # one fault was the target, none took place
    assert [f["counted"] for f in data["faults"]] == [False, False]

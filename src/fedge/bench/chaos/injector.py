"""Applying the schedule to the plant, and a watchdog that notices hung agents.

:class:`Injector` turns each :class:`~fedge.bench.chaos.schedule.Fault` into a begin and
an end action on the real processes, files and proxies, and records what it did (the
report's per-fault detail). :meth:`Injector.heal` ends whatever is still under way.
"""

import contextlib
import errno
import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from fedge.bench.chaos.clock import set_offset
from fedge.bench.chaos.plant import ChaosPlant, Station
from fedge.bench.chaos.proxy import ProxyMode
from fedge.bench.chaos.schedule import Fault, FaultKind

NET_MODES = {
    FaultKind.NET_DROP: ProxyMode.DROP,
    FaultKind.NET_STALL: ProxyMode.STALL,
    FaultKind.NET_TRUNCATE: ProxyMode.TRUNCATE,
}


@dataclass
class Applied:
    """What happened to one scheduled fault."""

    fault: Fault
    began_s: float | None = None
    ended_s: float | None = None
    notes: list[str] = field(default_factory=list)
    # False when the fault's effect could not be produced (a model_corrupt with no model
    # on disk kills the agent only): it is not counted as that kind of fault (issue 25).
    happened: bool = True

    @property
    def counts(self) -> bool:
        """Whether the fault took place as its kind says (applied, not failed)."""
        return self.happened and not any("failed" in note for note in self.notes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.fault.kind.value,
            "target": self.fault.target,
            "at_s": self.fault.at_s,
            "duration_s": self.fault.duration_s,
            **({"clock_offset_s": self.fault.clock_offset_s} if self.fault.clock_offset_s else {}),
            "began_s": None if self.began_s is None else round(self.began_s, 2),
            "ended_s": None if self.ended_s is None else round(self.ended_s, 2),
            "notes": self.notes,
            "counted": self.counts,
        }


def fill_disk(path: Any) -> int:
    """Fill the file system holding ``path`` (a new file) up to ENOSPC; return bytes taken."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (1 << 20, 1 << 12):
            block = b"\0" * chunk
            while True:
                try:
                    written += os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return written


def flip_byte(path: Any) -> None:
    """Flip one bit in the middle of a file in place (a bad sector, a bad copy)."""
    with open(path, "r+b") as handle:
        handle.seek(0, os.SEEK_END)
        middle = handle.tell() // 2
        handle.seek(middle)
        byte = handle.read(1)
        handle.seek(middle)
        handle.write(bytes([byte[0] ^ 0x01]))


class Injector:
    def __init__(self, plant: ChaosPlant, started: float) -> None:
        self.plant = plant
        self.started = started  # time.monotonic() at the start of the chaos phase
        self.applied: list[Applied] = []
        self._open: dict[int, Applied] = {}

    def _now(self) -> float:
        return time.monotonic() - self.started

    def begin(self, fault: Fault) -> None:
        record = Applied(fault, began_s=self._now())
        self.applied.append(record)
        self._open[id(fault)] = record
        try:
            self._begin(fault, record)
        except Exception as exc:  # recorded: a fault that could not be applied is data
            record.notes.append(f"begin failed: {type(exc).__name__}: {exc}")

    def end(self, fault: Fault) -> None:
        record = self._open.pop(id(fault), None)
        if record is None:
            return
        try:
            self._end(fault, record)
        except Exception as exc:
            record.notes.append(f"end failed: {type(exc).__name__}: {exc}")
        record.ended_s = self._now()

    def heal(self) -> None:
        """End every fault still under way (the schedule ends them all; this is the net)."""
        for record in list(self._open.values()):
            self.end(record.fault)

    # -- the actions

    def _station(self, fault: Fault) -> Station:
        return self.plant.stations[fault.target]

    def _begin(self, fault: Fault, record: Applied) -> None:
        kind = fault.kind
        if kind is FaultKind.BROKER_RESTART:
            self.plant.broker.stop()
        elif kind is FaultKind.BROKER_KILL:
            self.plant.broker.stop(kill=True)
        elif kind is FaultKind.MANAGER_KILL:
            self.plant.manager.kill()
        elif kind is FaultKind.AGENT_KILL:
            self._station(fault).kill()
        elif kind in NET_MODES:
            self._station(fault).proxy.set_mode(NET_MODES[kind])
        elif kind is FaultKind.DISK_FULL:
            station = self._station(fault)
            taken = fill_disk(station.ballast)
            record.notes.append(f"filled {taken} bytes")
        elif kind is FaultKind.MANAGER_DISK_FULL:
            taken = fill_disk(self.plant.manager_ballast)
            record.notes.append(f"filled {taken} bytes of the manager's home")
        elif kind is FaultKind.MODEL_CORRUPT:
            station = self._station(fault)
            path = station.active_model_path()
            if path is None or not path.exists():
                record.notes.append("no active model on disk yet: agent killed only")
                record.happened = False
            else:
                flip_byte(path)
                ref = f"{path.parent.parent.name}:{path.parent.name}"
                record.notes.append(f"flipped a bit of {ref}")
            # Every start verifies the active model: the restart is what finds the damage.
            station.kill()
        elif kind is FaultKind.CLOCK_JUMP:
            set_offset(self._station(fault).clock_file, fault.clock_offset_s)

    def _end(self, fault: Fault, record: Applied) -> None:
        kind = fault.kind
        if kind in (FaultKind.BROKER_RESTART, FaultKind.BROKER_KILL):
            self.plant.broker.start()
        elif kind is FaultKind.MANAGER_KILL:
            self.plant.manager.start()
        elif kind in (FaultKind.AGENT_KILL, FaultKind.MODEL_CORRUPT):
            self._station(fault).start()
        elif kind in NET_MODES:
            self._station(fault).proxy.set_mode(ProxyMode.PASS)
        elif kind is FaultKind.DISK_FULL:
            self._station(fault).ballast.unlink(missing_ok=True)
        elif kind is FaultKind.MANAGER_DISK_FULL:
            self.plant.manager_ballast.unlink(missing_ok=True)
        elif kind is FaultKind.CLOCK_JUMP:
            set_offset(self._station(fault).clock_file, 0.0)


def agent_status(station: Station, timeout_s: float) -> dict[str, Any]:
    url = f"http://127.0.0.1:{station.http_port}/v1/status"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        status: dict[str, Any] = json.loads(response.read())
    return status


class Watchdog(threading.Thread):
    """Polls every live agent's ``/v1/status``; an answer slower than ``timeout_s`` from a
    running process is an incident (the end check decides what is hung for good)."""

    def __init__(
        self, plant: ChaosPlant, started: float, timeout_s: float = 10.0, every_s: float = 3.0
    ) -> None:
        super().__init__(name="watchdog", daemon=True)
        self.plant = plant
        self.started = started
        self.timeout_s = timeout_s
        self.every_s = every_s
        self.halt = threading.Event()
        self.incidents: list[dict[str, Any]] = []
        self.polls = 0

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            for station in self.plant.stations.values():
                if not station.alive:
                    continue
                self.polls += 1
                began = time.monotonic()
                try:
                    agent_status(station, self.timeout_s)
                except OSError as exc:
                    # Refused while it starts up is normal; a timeout from a live process
                    # is not.
                    if station.alive and time.monotonic() - began >= self.timeout_s * 0.9:
                        with contextlib.suppress(Exception):
                            self.incidents.append(
                                {
                                    "edge": station.edge,
                                    "at_s": round(began - self.started, 1),
                                    "error": f"{type(exc).__name__}: {exc}"[:200],
                                }
                            )

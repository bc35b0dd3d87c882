"""The chaos run's fault schedule: pure, a function of the seed and the plant's shape.

A schedule is a tuple of :class:`Fault` sorted by start time. Faults never overlap on the
same target (one broker, one manager, one slot per agent covering the agent process, its
network path and its disk), so every fault starts from a healthy target and the heal
phase has exactly one thing to undo per target. Every kind appears at least once when
the run has room for it (issue 9: ">= 40 faults of at least 6 kinds").
"""

import random
from dataclasses import dataclass
from enum import StrEnum

BROKER = "broker"
MANAGER = "manager"


class FaultKind(StrEnum):
    BROKER_RESTART = "broker_restart"  # SIGTERM, down for duration_s, start again
    BROKER_KILL = "broker_kill"  # SIGKILL, down for duration_s, start again
    MANAGER_KILL = "manager_kill"  # SIGKILL `fedge manager serve`, restart after duration_s
    AGENT_KILL = "agent_kill"  # SIGKILL `fedge agent run`, restart after duration_s
    NET_DROP = "net_drop"  # the agent's proxy closes its connections and refuses new ones
    NET_STALL = "net_stall"  # the proxy holds every byte (connections stay open)
    NET_TRUNCATE = "net_truncate"  # the proxy forwards part of a chunk, then cuts
    DISK_FULL = "disk_full"  # the station's tmpfs is filled to the last byte
    # The manager home's tmpfs (store, broker save file) filled to the last byte (issue 33)
    MANAGER_DISK_FULL = "manager_disk_full"
    MODEL_CORRUPT = "model_corrupt"  # a byte of the active model flipped, agent restarted
    CLOCK_JUMP = "clock_jump"  # the agent's wall clock steps by clock_offset_s, then back


AGENT_KINDS = frozenset(
    {
        FaultKind.AGENT_KILL,
        FaultKind.NET_DROP,
        FaultKind.NET_STALL,
        FaultKind.NET_TRUNCATE,
        FaultKind.DISK_FULL,
        FaultKind.MODEL_CORRUPT,
        FaultKind.CLOCK_JUMP,
    }
)

# How long each kind lasts (seconds, uniform). Short enough that a 5-minute run holds
# ~50 faults, long enough that backlogs build up and reconnect back-off kicks in.
DURATIONS: dict[FaultKind, tuple[float, float]] = {
    FaultKind.BROKER_RESTART: (1.0, 4.0),
    FaultKind.BROKER_KILL: (1.0, 4.0),
    FaultKind.MANAGER_KILL: (1.0, 4.0),
    FaultKind.AGENT_KILL: (0.5, 3.0),
    FaultKind.NET_DROP: (2.0, 6.0),
    FaultKind.NET_STALL: (2.0, 8.0),
    FaultKind.NET_TRUNCATE: (1.0, 4.0),
    FaultKind.DISK_FULL: (3.0, 8.0),
    FaultKind.MANAGER_DISK_FULL: (3.0, 10.0),
    FaultKind.MODEL_CORRUPT: (0.5, 2.0),
    FaultKind.CLOCK_JUMP: (3.0, 10.0),
}
# A clock step of 10 minutes to 2 days, either way (a dead RTC battery, an NTP step).
CLOCK_STEP_S = (600.0, 2 * 86400.0)


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    at_s: float  # seconds after the chaos phase started
    target: str  # "broker", "manager" or an edge id
    duration_s: float
    clock_offset_s: float = 0.0  # clock_jump only

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s


@dataclass(frozen=True)
class PlantShape:
    """What the schedule may aim at."""

    edges: tuple[str, ...]
    disk_edges: tuple[str, ...]  # edges whose data dir is a small file system of its own
    manager_disk: bool = False  # the manager home is a small file system of its own


def kinds_for(shape: PlantShape) -> tuple[FaultKind, ...]:
    """The kinds this plant supports (disk-full needs a station on its own file system,
    manager-disk-full a manager home on one)."""
    return tuple(
        k
        for k in FaultKind
        if (k is not FaultKind.DISK_FULL or shape.disk_edges)
        and (k is not FaultKind.MANAGER_DISK_FULL or shape.manager_disk)
    )


def _targets(kind: FaultKind, shape: PlantShape) -> tuple[str, ...]:
    if kind in (FaultKind.BROKER_RESTART, FaultKind.BROKER_KILL):
        return (BROKER,)
    if kind in (FaultKind.MANAGER_KILL, FaultKind.MANAGER_DISK_FULL):
        # One target: a manager is never killed while its disk is full (a full store
        # refuses `manager serve` at start, by design).
        return (MANAGER,)
    if kind is FaultKind.DISK_FULL:
        return shape.disk_edges
    return shape.edges


def build_schedule(
    seed: int,
    duration_s: float,
    shape: PlantShape,
    *,
    faults_per_minute: float = 10.0,
    settle_s: float = 5.0,
) -> tuple[Fault, ...]:
    """Faults for a chaos phase of ``duration_s``, deterministic for ``seed``.

    Start times are evenly spaced slots with jitter, from ``settle_s`` to ``duration_s -
    settle_s`` (the load runs a little before the first and after the last fault). Kinds
    come from a shuffled deck holding every kind once, then uniform draws; a kind whose
    every target is busy at that moment is swapped for one whose target is free.
    """
    if duration_s <= 2 * settle_s:
        raise ValueError(f"a chaos phase of {duration_s:.0f}s leaves no room for faults")
    if not shape.edges:
        raise ValueError("a chaos run needs at least one agent")
    rng = random.Random(seed)
    kinds = kinds_for(shape)
    window = duration_s - 2 * settle_s
    count = max(1, round(window / 60.0 * faults_per_minute))
    spacing = window / count
    deck = list(kinds)
    rng.shuffle(deck)
    busy_until: dict[str, float] = {}
    faults: list[Fault] = []
    for slot in range(count):
        at_s = settle_s + slot * spacing + rng.uniform(0.0, spacing * 0.5)
        from_deck = bool(deck)
        wanted = deck.pop(0) if deck else rng.choice(kinds)
        # The wanted kind first, then the others in a seeded order.
        others = [k for k in kinds if k is not wanted]
        rng.shuffle(others)
        for kind in (wanted, *others):
            free = [t for t in _targets(kind, shape) if busy_until.get(t, -1.0) < at_s]
            if not free:
                continue
            target = rng.choice(free)
            low, high = DURATIONS[kind]
            # Never past the end of the chaos phase: the heal phase starts from a plant
            # whose faults all ended on schedule.
            duration = min(rng.uniform(low, high), max(0.5, duration_s - at_s - 1.0))
            offset = 0.0
            if kind is FaultKind.CLOCK_JUMP:
                offset = rng.choice((-1.0, 1.0)) * rng.uniform(*CLOCK_STEP_S)
            fault = Fault(kind, round(at_s, 3), target, round(duration, 3), round(offset, 1))
            faults.append(fault)
            # A little slack after each fault: a restarted process gets to come up
            # before the same target is hit again.
            busy_until[target] = fault.end_s + 2.0
            if kind is not wanted and from_deck:
                deck.insert(0, wanted)  # still owed: try it at the next slot
            break
    return tuple(faults)

"""Simulated devices: how fast each party is, whether it is up, and its virtual round time.

Parties report the **virtual** time their work would take on their device rather than the
wall time of the simulation, so results do not depend on the machine running them
(../shared/research/fl-algorithms.md section 9.2)::

    compute  = n_examples * epochs * seconds_per_example / cpus * LogNormal(0, jitter_sigma)
    transfer = 2 * model_bytes * 8 / (bandwidth_mbps * 1e6)        # download + upload
    virtual_round_time = compute + transfer

Every random decision is a pure function of ``(seed, partition_id, server_round)``: the
party and anyone on the server side who wants to predict it (a deadline-aware strategy, a
report) get the same answer. Availability is an independent on/off draw per round, and a
party that starts a round drops out with probability ``dropout``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from fedge.sim.errors import SimError
from fedge.sim.scenario import DeviceSpec, FleetSpec, Scenario

# The last entry of every per-round RNG key, so the three decisions are independent.
_AVAILABILITY_STREAM, _DROPOUT_STREAM, _JITTER_STREAM = range(3)
_SPEED_STREAM = 1_000  # per-fleet lognormal speeds (not per round)


class SimulatedFailure(SimError):
    """A simulated party did not complete its round (the failure is part of the experiment)."""


class PartyUnavailableError(SimulatedFailure):
    """The party is switched off in this round (``device.availability``)."""


class PartyDroppedOutError(SimulatedFailure):
    """The party started the round but failed before replying (``device.dropout``)."""


@dataclass(frozen=True)
class DeviceProfile:
    """What the simulator knows about one party's device."""

    cpus: float
    """Relative compute; a party with 4 CPUs trains 40x faster than one with 0.1."""
    bandwidth_mbps: float
    availability: float
    dropout: float
    jitter_sigma: float
    group: int | None
    """Index in ``fleet.groups`` (None for a lognormal fleet). Ground truth for reports;
    a tiering strategy must discover tiers from reported times, not read this."""


def profiles_for(scenario: Scenario, seed: int) -> tuple[DeviceProfile, ...]:
    """Every party's device, indexed by partition id (deterministic for ``seed``).

    Groups own consecutive partition ids in the order they are listed. A lognormal fleet
    draws each party's ``cpus`` from LogNormal(0, ``fleet.lognormal_sigma``) (median 1,
    FedScale-style) and gives every party ``device.bandwidth_mbps``.
    """
    return _profiles(scenario.fleet, scenario.device, seed)


@functools.lru_cache(maxsize=16)
def _profiles(fleet: FleetSpec, device: DeviceSpec, seed: int) -> tuple[DeviceProfile, ...]:
    def profile(cpus: float, bandwidth_mbps: float | None, group: int | None) -> DeviceProfile:
        return DeviceProfile(
            cpus=cpus,
            bandwidth_mbps=device.bandwidth_mbps if bandwidth_mbps is None else bandwidth_mbps,
            availability=device.availability,
            dropout=device.dropout,
            jitter_sigma=device.jitter_sigma,
            group=group,
        )

    if fleet.speed_distribution == "lognormal":
        sigma = fleet.lognormal_sigma or 0.0
        speeds = np.random.default_rng([seed, _SPEED_STREAM]).lognormal(0.0, sigma, fleet.parties)
        return tuple(profile(float(cpus), None, None) for cpus in speeds)
    return tuple(
        profile(group.cpus, group.bandwidth_mbps, index)
        for index, group in enumerate(fleet.groups)
        for _ in range(group.count)
    )


def virtual_round_time(
    profile: DeviceProfile,
    n_examples: int,
    epochs: int,
    model_bytes: int,
    seconds_per_example: float,
    rng: np.random.Generator,
) -> float:
    """Virtual seconds for one round: local training plus model download and upload.

    Draws exactly one LogNormal(0, ``profile.jitter_sigma``) factor from ``rng`` (a factor
    of 1 when sigma is 0). Pass :func:`round_rng` to get the party's own draw for a round.
    """
    jitter = float(rng.lognormal(0.0, profile.jitter_sigma))
    compute = n_examples * epochs * seconds_per_example / profile.cpus * jitter
    transfer = 2 * model_bytes * 8 / (profile.bandwidth_mbps * 1e6)
    return compute + transfer


def round_rng(seed: int, partition_id: int, server_round: int) -> np.random.Generator:
    """The jitter RNG of one party in one round (the same wherever it is rebuilt)."""
    return _round_rng(seed, partition_id, server_round, _JITTER_STREAM)


def is_available(profile: DeviceProfile, seed: int, partition_id: int, server_round: int) -> bool:
    """Whether the party is up in ``server_round`` (independent draw per round)."""
    draw = _round_rng(seed, partition_id, server_round, _AVAILABILITY_STREAM).random()
    return bool(draw < profile.availability)


def drops_out(profile: DeviceProfile, seed: int, partition_id: int, server_round: int) -> bool:
    """Whether the party, having started ``server_round``, fails before replying."""
    draw = _round_rng(seed, partition_id, server_round, _DROPOUT_STREAM).random()
    return bool(draw < profile.dropout)


def _round_rng(seed: int, partition_id: int, server_round: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, partition_id, server_round, stream])

"""Device profiles: TiFL's 40:1 spread, the virtual-time formula, deterministic failures."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fedge.sim.profiles import (
    DeviceProfile,
    drops_out,
    is_available,
    profiles_for,
    round_rng,
    virtual_round_time,
)
from fedge.sim.scenario import Scenario, load_scenario


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return load_scenario("tifl-digits")


def with_device(scenario: Scenario, **changes: float) -> Scenario:
    return dataclasses.replace(scenario, device=dataclasses.replace(scenario.device, **changes))


def test_groups_give_a_forty_to_one_spread_in_partition_order(scenario: Scenario) -> None:
    profiles = profiles_for(scenario, 0)
    assert len(profiles) == 50
    cpus = [p.cpus for p in profiles]
    assert max(cpus) / min(cpus) == pytest.approx(40.0)
    assert cpus[:10] == [4.0] * 10 and cpus[-10:] == [0.1] * 10
    assert [p.group for p in profiles[::10]] == [0, 1, 2, 3, 4]
    assert {p.bandwidth_mbps for p in profiles} == {scenario.device.bandwidth_mbps}
    assert profiles_for(scenario, 1) == profiles  # groups do not depend on the seed


def test_lognormal_speeds_are_deterministic_per_seed(scenario: Scenario) -> None:
    fleet = dataclasses.replace(
        scenario.fleet, groups=(), speed_distribution="lognormal", lognormal_sigma=0.6
    )
    lognormal = dataclasses.replace(scenario, fleet=fleet)
    first = [p.cpus for p in profiles_for(lognormal, 5)]
    assert first == [p.cpus for p in profiles_for(lognormal, 5)]
    assert first != [p.cpus for p in profiles_for(lognormal, 6)]
    assert len(set(first)) == 50 and all(p.group is None for p in profiles_for(lognormal, 5))
    assert 0.5 < float(np.median(first)) < 2.0  # LogNormal(0, sigma) has median 1


def test_virtual_time_is_compute_plus_two_transfers() -> None:
    profile = DeviceProfile(
        cpus=0.5, bandwidth_mbps=8.0, availability=1.0, dropout=0.0, jitter_sigma=0.0, group=3
    )
    # compute = 30 * 2 * 0.05 / 0.5 = 6 s; transfer = 2 * 1e6 B * 8 / 8e6 b/s = 2 s.
    seconds = virtual_round_time(profile, 30, 2, 1_000_000, 0.05, np.random.default_rng(0))
    assert seconds == pytest.approx(8.0)


def test_jitter_multiplies_compute_only() -> None:
    profile = DeviceProfile(
        cpus=1.0, bandwidth_mbps=1.0, availability=1.0, dropout=0.0, jitter_sigma=0.3, group=0
    )
    factor = float(np.random.default_rng(42).lognormal(0.0, 0.3))
    seconds = virtual_round_time(profile, 10, 1, 125_000, 0.1, np.random.default_rng(42))
    assert seconds == pytest.approx(1.0 * factor + 2.0)
    again = virtual_round_time(profile, 10, 1, 125_000, 0.1, round_rng(7, 3, 12))
    assert again == virtual_round_time(profile, 10, 1, 125_000, 0.1, round_rng(7, 3, 12))
    assert again != virtual_round_time(profile, 10, 1, 125_000, 0.1, round_rng(7, 3, 13))


def test_availability_is_deterministic_per_seed_party_and_round(scenario: Scenario) -> None:
    flaky = with_device(scenario, availability=0.7)
    profile = profiles_for(flaky, 0)[0]
    draws = [[is_available(profile, 0, pid, r) for r in range(1, 201)] for pid in range(10)]
    assert draws == [[is_available(profile, 0, pid, r) for r in range(1, 201)] for pid in range(10)]
    rate = np.mean(draws)
    assert 0.65 < rate < 0.75
    other_seed = [[is_available(profile, 1, pid, r) for r in range(1, 201)] for pid in range(10)]
    assert other_seed != draws
    always = profiles_for(scenario, 0)[0]
    assert all(is_available(always, 0, pid, r) for pid in range(50) for r in range(1, 50))


def test_dropout_is_an_independent_deterministic_draw(scenario: Scenario) -> None:
    profile = profiles_for(with_device(scenario, dropout=0.3, availability=0.5), 0)[0]
    outs = [drops_out(profile, 2, 4, r) for r in range(1, 1001)]
    assert outs == [drops_out(profile, 2, 4, r) for r in range(1, 1001)]
    assert math.isclose(np.mean(outs), 0.3, abs_tol=0.05)
    ups = [is_available(profile, 2, 4, r) for r in range(1, 1001)]
    assert outs != [not up for up in ups]  # separate streams, not one draw reused
    never = profiles_for(scenario, 0)[0]
    assert not any(drops_out(never, 0, 1, r) for r in range(1, 500))

"""Digits partitions: deterministic, disjoint, group shares kept, Dirichlet skew visible."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedge.datasets.tables import Partitions, load_dataset
from fedge.sim.data import (
    make_partitions,
    party_sizes,
    validation_size,
)
from fedge.sim.scenario import Scenario, load_scenario


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return load_scenario("tifl-digits")


def with_alpha(scenario: Scenario, alpha: float) -> Scenario:
    return dataclasses.replace(scenario, data=dataclasses.replace(scenario.data, alpha=alpha))


def all_party_indices(parts: Partitions) -> np.ndarray:
    return np.concatenate([*parts.party_indices, *parts.validation_indices])


def test_digits_load_offline_scaled_to_unit_range() -> None:
    X, y = load_dataset("digits")
    assert X.shape == (1797, 64) and X.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int64
    assert X.min() == 0.0 and X.max() == 1.0
    assert set(np.unique(y)) == set(range(10))


def test_the_same_seed_gives_the_same_split(scenario: Scenario) -> None:
    first = make_partitions(scenario, 3)
    assert make_partitions(scenario, 3) is first  # cached per process
    rebuilt = make_partitions(with_alpha(scenario, 0.5), 3)  # equal specs, same cache entry
    assert rebuilt is first
    other = make_partitions(scenario, 4)
    assert not np.array_equal(other.test_indices, first.test_indices)
    for mine, theirs in zip(first.party_indices, other.party_indices, strict=True):
        assert mine.shape == theirs.shape  # sizes come from the shares, not the seed
    with pytest.raises(ValueError):
        first.parties[0][0][0, 0] = 1.0  # shared cached arrays are read-only


def test_test_proxy_and_party_splits_are_disjoint_and_cover_the_dataset(
    scenario: Scenario,
) -> None:
    parts = make_partitions(scenario, 0)
    X, y = load_dataset()
    chunks = [parts.test_indices, parts.proxy_indices, all_party_indices(parts)]
    everything = np.concatenate(chunks)
    assert len(everything) == len(np.unique(everything)) == len(y)
    assert len(parts.test_indices) == round(0.2 * len(y))
    assert len(parts.proxy_indices) == round(0.1 * (len(y) - len(parts.test_indices)))
    # The rows match the indices, and the proxy set carries no labels.
    np.testing.assert_array_equal(parts.test[0], X[parts.test_indices])
    np.testing.assert_array_equal(parts.test[1], y[parts.test_indices])
    np.testing.assert_array_equal(parts.proxy_X, X[parts.proxy_indices])
    np.testing.assert_array_equal(parts.parties[7][1], y[parts.party_indices[7]])


def test_the_test_split_is_stratified(scenario: Scenario) -> None:
    parts = make_partitions(scenario, 0)
    _, y = load_dataset()
    expected = np.bincount(y) * 0.2
    assert np.all(np.abs(np.bincount(parts.test[1]) - expected) <= 1)


def test_group_shares_are_respected_to_one_sample(scenario: Scenario) -> None:
    parts = make_partitions(scenario, 1)
    pool = sum(parts.party_size(pid) for pid in range(parts.num_parties))
    start = 0
    for group in scenario.fleet.groups:
        sizes = [parts.party_size(pid) for pid in range(start, start + group.count)]
        per_party = group.data_share * pool / group.count
        assert all(abs(size - per_party) <= 1 for size in sizes), (group, sizes)
        start += group.count
    assert party_sizes(scenario.fleet, pool) == tuple(
        parts.party_size(pid) for pid in range(parts.num_parties)
    )


def test_each_party_keeps_ten_percent_for_validation(scenario: Scenario) -> None:
    parts = make_partitions(scenario, 0)
    for pid in range(parts.num_parties):
        n = parts.party_size(pid)
        assert len(parts.validation[pid][1]) == validation_size(n) == max(1, round(0.1 * n))
    assert [validation_size(n) for n in (0, 1, 2, 14, 15, 40)] == [0, 0, 1, 1, 2, 4]


def label_skew(parts: Partitions) -> float:
    """Mean total-variation distance between a party's label mix and the global mix."""
    labels = [
        np.concatenate([tr[1], va[1]])
        for tr, va in zip(parts.parties, parts.validation, strict=True)
    ]
    global_mix = np.bincount(np.concatenate(labels), minlength=10) / sum(map(len, labels))
    distances = [
        0.5 * np.abs(np.bincount(mine, minlength=10) / len(mine) - global_mix).sum()
        for mine in labels
    ]
    return float(np.mean(distances))


def test_small_alpha_skews_labels_more_than_large_alpha(scenario: Scenario) -> None:
    skewed = label_skew(make_partitions(with_alpha(scenario, 0.1), 0))
    mixed = label_skew(make_partitions(with_alpha(scenario, 100.0), 0))
    # Measured over seeds 0-4: 0.73-0.75 for alpha 0.1, 0.25-0.27 for alpha 100 (not 0:
    # a 13-39 sample shard is a noisy sample of even a uniform mix).
    assert skewed > 0.6
    assert mixed < 0.35
    assert skewed > 2 * mixed


def test_a_lognormal_fleet_splits_data_evenly(scenario: Scenario) -> None:
    fleet = dataclasses.replace(
        scenario.fleet, groups=(), speed_distribution="lognormal", lognormal_sigma=0.5
    )
    assert party_sizes(fleet, 103) == (3,) * 3 + (2,) * 47

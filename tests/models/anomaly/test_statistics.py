"""Sufficient statistics: federated sum = pooled fit, shrinkage, bad input."""

import numpy as np
import pytest

from fedge.models.anomaly import StatisticsError
from fedge.models.anomaly.statistics import (
    add_statistics,
    fit,
    mahalanobis,
    station_statistics,
)

GRID = (2, 3)


def _features(n: int, seed: int, dims: int = 5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(dims, dims))
    return rng.normal(size=(n, GRID[0] * GRID[1], dims)) @ mixing + rng.normal(size=dims)


def test_the_fit_from_summed_station_statistics_equals_the_pooled_fit() -> None:
    stations = [_features(n, seed) for seed, n in enumerate((40, 7, 1, 120))]
    pooled = np.concatenate(stations)
    federated = fit(add_statistics([station_statistics(x, GRID) for x in stations]))
    central = fit(station_statistics(pooled, GRID))
    assert federated.count == central.count == 168
    np.testing.assert_allclose(federated.mean, central.mean, rtol=0, atol=1e-12)
    np.testing.assert_allclose(federated.covariance, central.covariance, rtol=0, atol=1e-10)
    probe = _features(9, 99)
    np.testing.assert_allclose(
        mahalanobis(federated, probe), mahalanobis(central, probe), rtol=0, atol=1e-9
    )


def test_without_shrinkage_the_fit_is_the_sample_mean_and_covariance() -> None:
    x = _features(300, 3)
    model = fit(station_statistics(x, GRID), prior_parts=0.0, ridge=1e-12)
    np.testing.assert_allclose(model.mean, x.mean(axis=0), atol=1e-12)
    for location in range(x.shape[1]):
        np.testing.assert_allclose(
            model.covariance[location], np.cov(x[:, location].T), rtol=1e-9, atol=1e-9
        )


def test_two_parts_give_an_invertible_covariance_and_finite_distances() -> None:
    x = _features(2, 5, dims=12)  # rank 1 scatter in 12 dimensions
    model = fit(station_statistics(x, GRID))
    assert np.all(np.linalg.eigvalsh(model.covariance) > 0)
    distances = mahalanobis(model, _features(4, 6, dims=12))
    assert np.all(np.isfinite(distances)) and np.all(distances > 0)


def test_a_constant_feature_stays_invertible_through_the_ridge() -> None:
    x = np.zeros((10, GRID[0] * GRID[1], 3))
    model = fit(station_statistics(x, GRID))
    np.testing.assert_allclose(model.covariance[0], 0.01 * np.eye(3))


def test_shrinkage_fades_as_parts_accumulate() -> None:
    few = fit(station_statistics(_features(10, 1), GRID))
    many = fit(station_statistics(_features(5000, 1), GRID))
    raw_many = fit(station_statistics(_features(5000, 1), GRID), prior_parts=0.0)
    off_diagonal = ~np.eye(5, dtype=bool)
    # Many parts: nearly the sample covariance; few: pulled towards the diagonal.
    assert np.max(np.abs(many.covariance - raw_many.covariance)) < 0.02 * np.max(
        np.abs(raw_many.covariance)
    )
    ratio_few = np.abs(few.covariance[0][off_diagonal]).sum() / np.trace(few.covariance[0])
    ratio_many = np.abs(many.covariance[0][off_diagonal]).sum() / np.trace(many.covariance[0])
    assert ratio_few < ratio_many


def test_a_station_with_no_good_parts_is_an_error() -> None:
    with pytest.raises(StatisticsError, match="no good parts"):
        station_statistics(np.zeros((0, 6, 5)), GRID)


def test_statistics_of_other_backbones_do_not_add() -> None:
    a = station_statistics(_features(3, 1), GRID)
    b = station_statistics(_features(3, 1, dims=4), GRID)
    with pytest.raises(StatisticsError, match="different backbones"):
        add_statistics([a, b])
    with pytest.raises(StatisticsError, match="no station"):
        add_statistics([])


def test_non_finite_features_are_refused() -> None:
    x = _features(3, 1)
    x[0, 0, 0] = np.nan
    with pytest.raises(StatisticsError, match="NaN"):
        station_statistics(x, GRID)

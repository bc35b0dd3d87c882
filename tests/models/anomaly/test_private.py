"""The DP release of a station's statistics: clipping, noise, accounting."""

import numpy as np
import pytest

from fedge.models.anomaly import StatisticsError
from fedge.models.anomaly.private import clip_features, noisy_statistics, sensitivity
from fedge.models.anomaly.statistics import fit, station_statistics
from fedge.privacy.accounting import epsilon_spent
from fedge.privacy.settings import DpRelease

GRID = (2, 2)


def test_clipping_bounds_every_locations_norm_and_keeps_small_vectors() -> None:
    x = np.random.default_rng(0).normal(size=(50, 4, 6)) * 3.0
    clipped = clip_features(x, 2.0)
    assert np.all(np.linalg.norm(clipped, axis=2) <= 2.0 + 1e-12)
    small = x / 100.0
    np.testing.assert_array_equal(clip_features(small, 2.0), small)


def test_noise_has_the_mechanisms_scale_and_keeps_outer_products_symmetric() -> None:
    x = clip_features(np.random.default_rng(1).normal(size=(400, 4, 3)), 1.0)
    clean = station_statistics(x, GRID)
    noisy = noisy_statistics(clean, clip=1.0, noise_multiplier=0.5, rng=np.random.default_rng(2))
    np.testing.assert_allclose(noisy.outer, np.swapaxes(noisy.outer, 1, 2))
    residual = (noisy.total - clean.total).ravel()
    expected_sigma = 0.5 * sensitivity(4)
    assert 0.6 * expected_sigma < residual.std() < 1.5 * expected_sigma
    model = fit(noisy)  # noise may break PSD; the fit still gives an invertible model
    assert np.all(np.linalg.eigvalsh(model.covariance) > 0)


def test_the_release_is_accounted_as_one_gaussian_mechanism() -> None:
    # sigma = 2 on the whole data set once: RDP gives epsilon 2.17 at delta 1e-5.
    epsilon = epsilon_spent([DpRelease(noise_multiplier=2.0, sample_rate=1.0, steps=1)], 1e-5)
    assert 1.5 < epsilon < 3.5


def test_bad_parameters_are_refused() -> None:
    stats = station_statistics(np.ones((2, 4, 3)), GRID)
    rng = np.random.default_rng(0)
    with pytest.raises(StatisticsError, match="noise multiplier"):
        noisy_statistics(stats, clip=1.0, noise_multiplier=0.0, rng=rng)
    with pytest.raises(StatisticsError, match="clipping norm"):
        clip_features(np.ones((1, 4, 3)), -1.0)

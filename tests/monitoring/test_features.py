"""Image and score statistics: one image or a batch give the same numbers."""

import numpy as np
import pytest

from fedge.monitoring.features import MAX_SIDE, image_stats, image_stats_many, score_features


def test_a_batch_gives_what_each_image_gives_and_numpys_percentiles() -> None:
    images = np.random.default_rng(3).random((16, 1, 32, 32)).astype(np.float32)
    batch = image_stats_many(images)
    for image, stats in zip(images, batch, strict=True):
        assert stats == image_stats(image)
        p05, p95 = np.percentile(image.astype(np.float64), [5.0, 95.0])
        assert stats["p05"] == round(float(p05), 6) and stats["p95"] == round(float(p95), 6)
        assert stats["mean"] == round(float(image.mean(dtype=np.float64)), 6)


def test_brighter_and_blurred_images_move_the_statistics() -> None:
    image = np.random.default_rng(4).random((32, 32))
    base = image_stats(image)
    brighter = image_stats(np.clip(image * 0.5 + 0.5, 0, 1))
    assert brighter["mean"] > base["mean"] + 0.2 and brighter["p05"] > base["p05"]
    blurred = (image[:, :-1] + image[:, 1:]) / 2
    assert image_stats(blurred)["edges"] < base["edges"]


def test_large_images_are_sampled_on_a_grid() -> None:
    big = np.random.default_rng(5).random((1, 4 * MAX_SIDE, 4 * MAX_SIDE))
    assert image_stats(big) == image_stats(big[:, ::4, ::4])
    assert image_stats_many(np.empty((0, 8, 8))) == []


def test_channels_are_averaged_as_if_over_every_pixel() -> None:
    """The agent averages channels on the sampling grid only (the line camera's path,
    issue 25): the values are those of averaging the whole image first."""
    colour = np.random.default_rng(6).random((3, 3, 4 * MAX_SIDE, 4 * MAX_SIDE)).astype(np.float32)
    assert image_stats_many(colour) == image_stats_many(colour.mean(axis=1))
    grey = colour[:, :1]
    assert image_stats_many(grey) == image_stats_many(grey[:, 0])


def test_bad_shapes_and_scores_are_refused() -> None:
    with pytest.raises(ValueError, match="2-D or"):
        image_stats(np.zeros(5))
    with pytest.raises(ValueError, match=r"\(n, h, w\)"):
        image_stats_many(np.zeros((2, 0, 4)))
    with pytest.raises(ValueError, match="at least one score"):
        score_features({})
    features = score_features({"clean": 0.9, "scratch": 0.1})
    assert features["top"] == 0.9 and abs(features["margin"] - 0.8) < 1e-12
    assert 0.0 < features["entropy"] < 1.0

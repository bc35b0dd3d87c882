"""Re-lit copies: what each lighting change does, and that a station's copies are seeded."""

import numpy as np
import pytest

from fedge.monitoring.relight import (
    FAMILY,
    LinearFamily,
    copy_seed,
    from_uint8,
    quantise,
    random_linear,
    relight_linear,
    relight_spot,
    relit_copies,
    to_uint8,
)


def images(n: int = 4, size: int = 16, seed: int = 0) -> np.ndarray:
    """8-bit-level images in [0.2, 0.8] (room on both sides for a lighting change)."""
    rng = np.random.default_rng(seed)
    return quantise(rng.uniform(0.2, 0.8, size=(n, size, size)))


def test_no_change_leaves_an_image_as_it_was() -> None:
    batch = images()
    rng = np.random.default_rng(1)
    same = relight_linear(batch, rng, gain=1.0, offset=0.0, gradient=0.0)
    np.testing.assert_allclose(same, batch, atol=1e-12)


def test_gain_offset_and_gradient_do_what_they_say() -> None:
    batch = images()
    rng = np.random.default_rng(1)
    brighter = relight_linear(batch, rng, gain=1.0, offset=0.1, gradient=0.0)
    np.testing.assert_allclose(brighter.mean(axis=(1, 2)), batch.mean(axis=(1, 2)) + 0.1, atol=3e-3)
    flatter = relight_linear(batch, rng, gain=0.5, offset=0.0, gradient=0.0)
    np.testing.assert_allclose(flatter.std(axis=(1, 2)), batch.std(axis=(1, 2)) * 0.5, atol=3e-3)
    np.testing.assert_allclose(flatter.mean(axis=(1, 2)), batch.mean(axis=(1, 2)), atol=3e-3)
    # A gradient on a flat grey image: a ramp of amplitude g*(|cos a| + |sin a|) in [g, g*sqrt 2].
    grey = quantise(np.full((8, 16, 16), 0.5))
    ramp = relight_linear(grey, rng, gain=1.0, offset=0.0, gradient=0.3)
    spread = ramp.max(axis=(1, 2)) - ramp.min(axis=(1, 2))
    assert np.all(spread >= 0.3 - 2 / 255) and np.all(spread <= 0.3 * np.sqrt(2) + 2 / 255)
    # One value per image, and channels share the image's lighting.
    per_image = relight_linear(
        np.stack([batch, batch], axis=1), rng, gain=1.0, offset=np.array([0.0, 0.05, 0.1, 0.15]),
        gradient=0.0,
    )  # fmt: skip
    assert per_image.shape == (4, 2, 16, 16)
    np.testing.assert_array_equal(per_image[:, 0], per_image[:, 1])
    np.testing.assert_allclose(per_image[3, 0].mean() - batch[3].mean(), 0.15, atol=3e-3)


def test_results_are_camera_like_clipped_and_8_bit() -> None:
    rng = np.random.default_rng(2)
    relit = relight_linear(images(), rng, gain=1.4, offset=0.3, gradient=1.0)
    assert relit.min() >= 0.0 and relit.max() <= 1.0 and relit.max() == 1.0  # clipped
    np.testing.assert_array_equal(relit * 255, np.round(relit * 255))
    eight_bit = to_uint8(relit)
    assert eight_bit.dtype == np.uint8
    np.testing.assert_array_equal(from_uint8(eight_bit), relit)


def test_a_spotlight_brightens_around_its_centre() -> None:
    dark = np.zeros((3, 33, 33))
    spot = relight_spot(dark, np.random.default_rng(3), gain=0.7, amplitude=0.5, sigma=0.25)
    for image in spot:
        assert image.max() == pytest.approx(0.5, abs=0.01)
        y, x = np.unravel_index(image.argmax(), image.shape)
        assert image[y, x] > image[(y + 16) % 33, (x + 16) % 33]  # fades away from it


def test_random_linear_stays_in_its_family() -> None:
    grey = quantise(np.full((200, 8, 8), 0.5))  # gain does nothing to a flat image: offset + ramp
    relit = random_linear(grey, np.random.default_rng(4))
    means = relit.mean(axis=(1, 2))
    assert np.all(means >= 0.5 + FAMILY.offset[0] - 0.01)
    assert np.all(means <= 0.5 + FAMILY.offset[1] + 0.01)
    assert means.std() > 0.1  # drawn per image
    narrow = LinearFamily(gain=(1.0, 1.0), offset=(0.0, 0.0), gradient=(0.0, 0.0))
    np.testing.assert_array_equal(random_linear(grey, np.random.default_rng(4), narrow), grey)
    with pytest.raises(ValueError, match="low <= high"):
        LinearFamily(gain=(1.4, 0.4))
    with pytest.raises(ValueError, match="negative"):
        LinearFamily(gradient=(-1.0, 1.0))


def test_a_stations_copies_are_seeded_by_the_image_and_the_copy() -> None:
    image = images(1)[0]
    two = relit_copies(image, "p-0001", 2)
    three = relit_copies(image, "p-0001", 3)
    assert len(two) == 2 and len(three) == 3
    for a, b in zip(two, three, strict=False):
        np.testing.assert_array_equal(a, b)  # copy k is copy k whatever the count
    assert not np.array_equal(two[0], two[1])
    assert not np.array_equal(two[0], relit_copies(image, "p-0002", 1)[0])
    assert relit_copies(image, "p-0001", 0) == []
    # Stable across processes and platforms (SHA-256, not Python's salted hash).
    assert copy_seed("p-0001", 1) == [16291811989851938669, 1]
    channels = relit_copies(np.stack([image, image]), "p-0001", 1)[0]
    assert channels.shape == (2, 16, 16)
    np.testing.assert_array_equal(channels[0], two[0])


def test_bad_input_is_refused() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="copies must be >= 0"):
        relit_copies(images(1)[0], "p", -1)
    with pytest.raises(ValueError, match=r"\(h, w\) or \(c, h, w\)"):
        relit_copies(np.zeros(5), "p", 1)
    with pytest.raises(ValueError, match=r"\(n, h, w\) or \(n, c, h, w\)"):
        relight_linear(np.zeros((4, 4)), rng, gain=1.0, offset=0.0, gradient=0.0)
    with pytest.raises(ValueError, match="NaN"):
        relight_spot(np.full((1, 4, 4), np.nan), rng, gain=1.0, amplitude=0.1, sigma=0.2)

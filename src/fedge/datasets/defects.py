"""A generated visual-inspection task: does a brushed-metal surface carry a scratch?

Every image is a brushed-metal texture (a gentle illumination gradient, a light hotspot,
fine streaks along a random brushing direction, sensor noise). Scratch images add one or
two thin bright or dark line segments. Scratch contrast is drawn log-uniformly down to
the noise floor and scratches may run along the brushing direction, so some of them are
genuinely hard to see: a small CNN lands in the high 90s rather than at 100 %.

Images are read back with the one preprocessing function training and serving share
(:func:`fedge.party.preprocess.prepare`). Numpy and Pillow only -- never torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image

CLASSES: tuple[str, str] = ("clean", "scratch")
"""Class names indexed by label: 0 = clean, 1 = scratch."""

# Texture: the streak profile is sampled across the brushing direction, so it must cover
# the image diagonal (sqrt(2) * size) plus interpolation margin.
_STREAK_AMPLITUDE = (0.01, 0.04)
_SENSOR_NOISE = (0.005, 0.015)
_GRADIENT_AMPLITUDE = (0.0, 0.18)
_HOTSPOT_AMPLITUDE = (0.0, 0.15)
_BASE_LEVEL = (0.3, 0.7)

# Scratches: contrast is log-uniform so faint scratches are as common per octave as bold
# ones; the low end sits near the texture's own contrast, which is what caps accuracy.
_SCRATCH_CONTRAST = (0.08, 0.45)
_SCRATCH_WIDTH = (0.45, 1.0)  # Gaussian sigma in pixels: "thin" means about 1-2 px wide
_SCRATCH_LENGTH = (0.25, 0.8)  # fraction of the image side
_SECOND_SCRATCH_PROBABILITY = 0.3
_DENT_SIGMA = (2.5, 4.0)  # pixels: far broader than any scratch
_DENT_CONTRAST = (0.08, 0.2)
_PIT_COUNT = (3, 7)  # pits per cluster, upper bound exclusive
_PIT_SIGMA = (0.6, 1.0)  # pixels: point-like, unlike a scratch's line
_PIT_SPREAD = (1.5, 3.0)  # pixels: how far pits scatter around the cluster's center
_PIT_CONTRAST = (0.1, 0.3)


def make_defect_images(
    n: int,
    *,
    size: int = 32,
    seed: int,
    scratch_fraction: float = 0.5,
    dent_fraction: float = 0.0,
    pit_fraction: float = 0.0,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Generate ``n`` grayscale inspection images and their labels.

    Returns ``(images, labels)``: ``images`` is uint8 of shape ``(n, size, size)`` and
    ``labels`` int64 of shape ``(n,)`` with 0 = clean and 1 = scratch (see ``CLASSES``).
    Exactly ``round(n * scratch_fraction)`` images carry a defect, in shuffled order.
    ``dent_fraction`` of the defective images carry a *dent* instead of a scratch: a
    broad, shallow bright or dark blob (a defect shape the scratch data never shows, as
    a station with another press or fixture sees it); they are labelled as defects (1).
    ``pit_fraction`` of them carry *pits* instead: a small cluster of 3-6 dark, point-like
    pits (corrosion or weld spatter), a second shape no scratch data shows; dents and pits
    never share an image (``dent_fraction + pit_fraction <= 1``).
    The result depends only on the arguments: the same seed gives the same bytes, and
    ``dent_fraction = pit_fraction = 0`` gives the bytes this function always gave (as
    does ``pit_fraction = 0`` for any ``dent_fraction``).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if size < 8:
        raise ValueError(f"size must be >= 8, got {size}")
    if not 0.0 <= scratch_fraction <= 1.0:
        raise ValueError(f"scratch_fraction must be in [0, 1], got {scratch_fraction}")

    rng = np.random.default_rng(seed)
    n_scratch = round(n * scratch_fraction)
    labels = np.zeros(n, dtype=np.int64)
    labels[:n_scratch] = 1
    labels = rng.permutation(labels)

    for name, fraction in (("dent_fraction", dent_fraction), ("pit_fraction", pit_fraction)):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {fraction}")
    if dent_fraction + pit_fraction > 1.0:
        raise ValueError(
            f"dent_fraction + pit_fraction must be <= 1, got {dent_fraction + pit_fraction}"
        )

    surface = _brushed_metal(rng, n, size)
    dented = np.zeros(n, dtype=bool)
    pitted = np.zeros(n, dtype=bool)
    if dent_fraction > 0 or pit_fraction > 0:
        # One draw per image picks its shape; with no pits it is the draw dents always used.
        shape_draw = rng.random(size=n)
        dented = (labels == 1) & (shape_draw < dent_fraction)
        pitted = (labels == 1) & ~dented & (shape_draw < dent_fraction + pit_fraction)
    surface += _scratches(rng, np.where(dented | pitted, 0, labels), size)
    if dent_fraction > 0:
        surface += _dents(rng, dented, size)
    if pit_fraction > 0:
        surface += _pits(rng, pitted, size)
    # Sensor noise goes on last so it also masks the faint scratches, as a camera would.
    noise_sigma = rng.uniform(*_SENSOR_NOISE, size=(n, 1, 1))
    surface += rng.normal(size=(n, size, size)) * noise_sigma

    images = np.round(np.clip(surface, 0.0, 1.0) * 255.0).astype(np.uint8)
    return images, labels


def _brushed_metal(rng: np.random.Generator, n: int, size: int) -> npt.NDArray[np.float64]:
    """Clean surfaces in [0, 1]-ish float: base level, gradient, hotspot and streaks."""
    coords = np.arange(size, dtype=np.float64) - (size - 1) / 2.0
    ys, xs = np.meshgrid(coords, coords, indexing="ij")  # each (size, size)
    xs_n, ys_n = xs / size, ys / size  # normalised to about [-0.5, 0.5]

    base = rng.uniform(*_BASE_LEVEL, size=(n, 1, 1))

    # Low-frequency illumination: a linear ramp in a random direction ...
    grad_angle = rng.uniform(0.0, 2.0 * np.pi, size=(n, 1, 1))
    grad_amp = rng.uniform(*_GRADIENT_AMPLITUDE, size=(n, 1, 1))
    gradient = grad_amp * (np.cos(grad_angle) * xs_n + np.sin(grad_angle) * ys_n)

    # ... plus a broad light hotspot somewhere near the image, as from a ring light.
    hot_center = rng.uniform(-0.6, 0.6, size=(n, 2, 1, 1))
    hot_radius = rng.uniform(0.3, 0.8, size=(n, 1, 1))
    hot_amp = rng.uniform(*_HOTSPOT_AMPLITUDE, size=(n, 1, 1))
    hot_d2 = (xs_n - hot_center[:, 0]) ** 2 + (ys_n - hot_center[:, 1]) ** 2
    hotspot = hot_amp * np.exp(-hot_d2 / (2.0 * hot_radius**2))

    # Brushing streaks: a 1-D noise profile across the brushing direction, lightly
    # smoothed, so every pixel on a line along the brush shares one value. Sampling at
    # the projected coordinate with linear interpolation handles any angle without
    # an image-rotation dependency.
    brush_angle = rng.uniform(0.0, np.pi, size=(n, 1, 1))
    across = -np.sin(brush_angle) * xs + np.cos(brush_angle) * ys  # pixels, |.| <= size/sqrt2
    half = int(np.ceil(size / np.sqrt(2.0))) + 2
    profile_len = 2 * half + 1
    profile = rng.normal(size=(n, profile_len))
    # A [1, 2, 1] blur gives streaks 1-3 px wide instead of single-pixel salt; dividing
    # by sqrt(6) keeps unit variance so streak_amp is the streaks' standard deviation.
    blurred = np.roll(profile, 1, axis=1) + 2.0 * profile + np.roll(profile, -1, axis=1)
    profile = blurred / np.sqrt(6.0)
    streak_amp = rng.uniform(*_STREAK_AMPLITUDE, size=(n, 1, 1))
    pos = (across + half).reshape(n, size * size)
    lo = np.floor(pos).astype(np.int64)
    frac = pos - lo
    left = np.take_along_axis(profile, lo, axis=1)
    right = np.take_along_axis(profile, lo + 1, axis=1)
    streaks = ((1.0 - frac) * left + frac * right).reshape(n, size, size) * streak_amp

    result: npt.NDArray[np.float64] = base + gradient + hotspot + streaks
    return result


def _dents(
    rng: np.random.Generator, dented: npt.NDArray[np.bool_], size: int
) -> npt.NDArray[np.float64]:
    """Additive dent layer: one broad Gaussian blob (sigma 2.5-4 px) where ``dented``."""
    n = dented.shape[0]
    coords = np.arange(size, dtype=np.float64)
    ys, xs = np.meshgrid(coords, coords, indexing="ij")
    center = rng.uniform(0.25 * size, 0.75 * size, size=(n, 2, 1, 1))
    sigma = rng.uniform(*_DENT_SIGMA, size=(n, 1, 1))
    contrast = rng.uniform(*_DENT_CONTRAST, size=(n, 1, 1))
    sign = np.where(rng.random(size=(n, 1, 1)) < 0.5, -1.0, 1.0)
    d2 = (xs - center[:, 0]) ** 2 + (ys - center[:, 1]) ** 2
    blob = sign * contrast * np.exp(-d2 / (2.0 * sigma**2))
    layer: npt.NDArray[np.float64] = blob * dented[:, None, None]
    return layer


def _pits(
    rng: np.random.Generator, pitted: npt.NDArray[np.bool_], size: int
) -> npt.NDArray[np.float64]:
    """Additive pit layer: a cluster of small dark Gaussian spots where ``pitted``.

    Parameters for the largest cluster are drawn for every image and masked (as
    :func:`_scratches` does), so the stream consumed does not depend on which are pitted.
    """
    n = pitted.shape[0]
    most = _PIT_COUNT[1] - 1
    coords = np.arange(size, dtype=np.float64)
    ys, xs = np.meshgrid(coords, coords, indexing="ij")
    center = rng.uniform(0.2 * size, 0.8 * size, size=(n, 1, 2, 1, 1))
    spread = rng.uniform(*_PIT_SPREAD, size=(n, 1, 1, 1, 1))
    spots = center + spread * rng.normal(size=(n, most, 2, 1, 1))
    sigma = rng.uniform(*_PIT_SIGMA, size=(n, most, 1, 1))
    contrast = rng.uniform(*_PIT_CONTRAST, size=(n, most, 1, 1))
    count = np.asarray(rng.integers(_PIT_COUNT[0], _PIT_COUNT[1], size=n), dtype=np.int64)
    present = (np.arange(most)[None, :] < count[:, None]) & pitted[:, None]
    d2 = (xs - spots[:, :, 0]) ** 2 + (ys - spots[:, :, 1]) ** 2  # (n, most, size, size)
    blobs = -contrast * np.exp(-d2 / (2.0 * sigma**2))  # pits are dark: they shade
    layer: npt.NDArray[np.float64] = np.einsum("nk,nkhw->nhw", present.astype(np.float64), blobs)
    return layer


def _scratches(
    rng: np.random.Generator, labels: npt.NDArray[np.int64], size: int
) -> npt.NDArray[np.float64]:
    """Additive scratch layer: zero for clean images, one or two segments otherwise.

    Parameters are drawn for every image (two segments each) and then masked, so the
    random stream consumed does not depend on which images are scratched.
    """
    n = labels.shape[0]
    coords = np.arange(size, dtype=np.float64)
    ys, xs = np.meshgrid(coords, coords, indexing="ij")

    shape = (n, 2, 1, 1)
    center = rng.uniform(0.15 * size, 0.85 * size, size=(n, 2, 2, 1, 1))
    angle = rng.uniform(0.0, np.pi, size=shape)
    half_len = 0.5 * size * rng.uniform(*_SCRATCH_LENGTH, size=shape)
    width = rng.uniform(*_SCRATCH_WIDTH, size=shape)
    log_lo, log_hi = np.log(_SCRATCH_CONTRAST[0]), np.log(_SCRATCH_CONTRAST[1])
    contrast = np.exp(rng.uniform(log_lo, log_hi, size=shape))
    sign = np.where(rng.random(size=shape) < 0.5, -1.0, 1.0)  # bright or dark scratch
    second = rng.random(size=n) < _SECOND_SCRATCH_PROBABILITY

    # Distance from every pixel to the segment center +- half_len * direction.
    dx, dy = np.cos(angle), np.sin(angle)
    rel_x, rel_y = xs - center[:, :, 0], ys - center[:, :, 1]
    along = np.clip(rel_x * dx + rel_y * dy, -half_len, half_len)
    dist2 = (rel_x - along * dx) ** 2 + (rel_y - along * dy) ** 2
    lines = sign * contrast * np.exp(-dist2 / (2.0 * width**2))  # (n, 2, size, size)

    present = np.zeros((n, 2), dtype=np.float64)
    present[:, 0] = labels == 1
    present[:, 1] = (labels == 1) & second
    layer: npt.NDArray[np.float64] = np.einsum("nk,nkhw->nhw", present, lines)
    return layer


def write_png_dir(images: npt.NDArray[np.uint8], dest: Path, prefix: str) -> list[Path]:
    """Write each image of a ``(n, h, w)`` uint8 stack as an 8-bit grayscale PNG.

    Files are named ``{prefix}_{index:05d}.png`` inside ``dest`` (created if missing);
    the paths are returned in image order.
    """
    if images.ndim != 3:
        raise ValueError(f"expected images of shape (n, h, w), got {images.shape}")
    if images.dtype != np.uint8:
        raise ValueError(f"expected uint8 images, got {images.dtype}")
    dest.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for index, image in enumerate(images):
        path = dest / f"{prefix}_{index:05d}.png"
        Image.fromarray(np.ascontiguousarray(image)).save(path, format="PNG")
        paths.append(path)
    return paths

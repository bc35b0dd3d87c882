"""Synthetic lighting changes: re-lit copies of held-out images, for the MPP predictor.

A correctness predictor fitted only on in-distribution held-out data has never seen the
inputs it is asked about once the line's lighting changes: its logistic regression
extrapolates linearly outside the held-out range of image statistics, and its error
under drift varies widely (``fedge bench mpp``, variant ``mpp_plain``). The remedy used
here is the one discussed for performance predictors in general: fit the predictor also
on synthetically shifted copies of the held-out data, whose labels are known because the
shift does not change them (Guillory et al., "Predicting with Confidence on Unseen
Distributions", ICCV'21, which learns accuracy predictors across synthetic shifts; Garg
et al., "Leveraging Unlabeled Data to Predict Out-of-Distribution Performance", ICLR'22,
whose ATC is calibrated on held-out data and evaluated on such shifts; the MPP predictor
itself is Ghanta et al., "ML Health: Fitness Tracking for Production Models", OpML'19).

The family is *linear* lighting (:data:`FAMILY`): a contrast gain about the image's mean,
a brightness offset, and a linear gradient (the light moved to one side). It covers what
a lamp that dims, brightens or moves does; it does not cover a spotlight
(:func:`relight_spot`), which the benchmark keeps as an out-of-family shift to say how
far the gain carries.

Pixels are floats in [0, 1] (a batch ``(n, h, w)`` or ``(n, channels, h, w)``); every
result is clipped and quantised to 8-bit levels, as a camera would deliver it. Random
draws come from the caller's generator, or, for :func:`relit_copies` (what a station
does), from a seed derived from the image's key and the copy's index, so both models of
an evaluation score the same copies and a repeated evaluation reproduces them. NumPy
only: the inference-only agent imports this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Pixels = npt.NDArray[np.float64]
Param = float | npt.NDArray[np.float64]


@dataclass(frozen=True)
class LinearFamily:
    """Uniform ranges of :func:`relight_linear`'s parameters, drawn per image."""

    gain: tuple[float, float] = (0.4, 1.4)
    offset: tuple[float, float] = (-0.3, 0.3)
    gradient: tuple[float, float] = (0.0, 1.0)

    def __post_init__(self) -> None:
        for name in ("gain", "offset", "gradient"):
            low, high = getattr(self, name)
            if not (np.isfinite(low) and np.isfinite(high) and low <= high):
                raise ValueError(f"relight family {name} range must be finite, low <= high")
        if self.gain[0] < 0 or self.gradient[0] < 0:
            raise ValueError("relight family gain and gradient must not be negative")


FAMILY = LinearFamily()
"""The augmentation family stations use (and ``fedge bench mpp`` measures)."""


def relight_linear(
    pixels: Pixels, rng: np.random.Generator, *, gain: Param, offset: Param, gradient: Param
) -> Pixels:
    """Contrast ``gain`` about each image's mean, plus ``offset``, plus a linear ramp.

    The ramp has amplitude ``gradient`` across the image in a direction drawn at random
    per image from ``rng``. Each parameter is a number or an array of one value per image.
    """
    batch = _batch(pixels)
    n = batch.shape[0]
    mean = batch.mean(axis=tuple(range(1, batch.ndim)), keepdims=True)
    ys, xs = _grid(batch.shape[-2], batch.shape[-1])
    angle = _per_image(rng.uniform(0.0, 2.0 * np.pi, size=n), batch.ndim)
    ramp = _per_image(gradient, batch.ndim) * (np.cos(angle) * xs + np.sin(angle) * ys)
    relit = (batch - mean) * _per_image(gain, batch.ndim) + mean + _per_image(offset, batch.ndim)
    return quantise(relit + ramp)


def relight_spot(
    pixels: Pixels, rng: np.random.Generator, *, gain: float, amplitude: float, sigma: float
) -> Pixels:
    """A dimmer lamp (``gain``) plus a Gaussian spotlight centred at random per image.

    Outside :data:`FAMILY` (not linear in the image coordinates): the benchmark's
    out-of-family lighting shift.
    """
    batch = _batch(pixels)
    ys, xs = _grid(batch.shape[-2], batch.shape[-1])
    centre = rng.uniform(-0.5, 0.5, size=(batch.shape[0], 2))
    cx, cy = _per_image(centre[:, 0], batch.ndim), _per_image(centre[:, 1], batch.ndim)
    d2 = (xs - cx) ** 2 + (ys - cy) ** 2
    return quantise(batch * gain + amplitude * np.exp(-d2 / (2.0 * sigma**2)))


def random_linear(
    pixels: Pixels, rng: np.random.Generator, family: LinearFamily = FAMILY
) -> Pixels:
    """Each image re-lit once with parameters drawn from ``family``."""
    batch = _batch(pixels)
    n = batch.shape[0]
    gain = rng.uniform(*family.gain, size=n)
    offset = rng.uniform(*family.offset, size=n)
    gradient = rng.uniform(*family.gradient, size=n)
    return relight_linear(batch, rng, gain=gain, offset=offset, gradient=gradient)


def copy_seed(key: str, copy: int) -> list[int]:
    """The seed of copy ``copy`` of the image named ``key``: stable across processes
    and platforms (SHA-256 of the key, not Python's salted ``hash``)."""
    digest = hashlib.sha256(key.encode()).digest()
    return [int.from_bytes(digest[:8], "big"), copy]


def relit_copies(
    image: Pixels, key: str, copies: int, family: LinearFamily = FAMILY
) -> list[Pixels]:
    """Copies ``1..copies`` of one image (``(h, w)`` or ``(channels, h, w)``), each re-lit
    from :data:`FAMILY` with its own seed (:func:`copy_seed`): copy ``k`` is the same
    whatever ``copies`` is, for every model that scores it."""
    if copies < 0:
        raise ValueError(f"copies must be >= 0, got {copies}")
    single = np.asarray(image, dtype=np.float64)
    if single.ndim not in (2, 3):
        raise ValueError(f"relit_copies needs an (h, w) or (c, h, w) image, got {single.shape}")
    return [
        random_linear(single[None], np.random.default_rng(copy_seed(key, k)), family)[0]
        for k in range(1, copies + 1)
    ]


def from_uint8(images: npt.NDArray[np.uint8]) -> Pixels:
    """8-bit images as floats in [0, 1]."""
    result: Pixels = np.asarray(images, dtype=np.float64) / 255.0
    return result


def to_uint8(pixels: Pixels) -> npt.NDArray[np.uint8]:
    """Floats in [0, 1] as 8-bit images (clipped, rounded)."""
    result: npt.NDArray[np.uint8] = np.round(np.clip(pixels, 0.0, 1.0) * 255.0).astype(np.uint8)
    return result


def quantise(pixels: Pixels) -> Pixels:
    """Clipped to [0, 1] and rounded to the 256 levels of an 8-bit camera."""
    result: Pixels = np.round(np.clip(pixels, 0.0, 1.0) * 255.0) / 255.0
    return result


def _batch(pixels: Pixels) -> Pixels:
    batch = np.asarray(pixels, dtype=np.float64)
    if batch.ndim not in (3, 4) or batch.shape[-1] == 0 or batch.shape[-2] == 0:
        raise ValueError(f"relight needs (n, h, w) or (n, c, h, w) pixels, got {batch.shape}")
    if not np.isfinite(batch).all():
        raise ValueError("relight got NaN or infinite pixels")
    return batch


def _per_image(value: Param, ndim: int) -> Pixels:
    """A number, or one value per image, shaped to broadcast over a batch of ``ndim``."""
    array = np.asarray(value, dtype=np.float64)
    return array if array.ndim == 0 else array.reshape((-1,) + (1,) * (ndim - 1))


def _grid(height: int, width: int) -> tuple[Pixels, Pixels]:
    """Pixel coordinates in [-0.5, 0.5] across each side."""
    ys = np.arange(height, dtype=np.float64) / max(height - 1, 1) - 0.5
    xs = np.arange(width, dtype=np.float64) / max(width - 1, 1) - 0.5
    grid_y, grid_x = np.meshgrid(ys, xs, indexing="ij")
    return grid_y, grid_x

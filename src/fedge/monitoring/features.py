"""What monitoring looks at: a few statistics of the image and of the model's scores.

Both are computed where the image is (the station), so nothing but these numbers leaves
it. The image statistics follow what MPP (Ghanta et al., "ML Health: Fitness Tracking
for Production Models", OpML'19) and data-validation systems watch on images: overall
brightness and contrast, the tails of the intensity histogram, and edge energy (sharpness,
which blur and focus drift change). The score features are the confidence signals a
correctness predictor uses: the top score, the margin to the second, and the entropy.

NumPy only: the inference-only agent imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

IMAGE_STATS = ("mean", "std", "p05", "p95", "edges")
MAX_SIDE = 32
SCORE_FEATURES = ("top", "margin", "entropy")


def image_stats(pixels: npt.NDArray[np.floating]) -> dict[str, float]:
    """Statistics of one prepared image (``(channels, h, w)`` or ``(h, w)``, any scale).

    ``edges`` is the mean absolute difference between neighbouring pixels (of the
    sampling grid, for images over ``MAX_SIDE`` pixels a side), a cheap sharpness
    measure. Values are rounded to 6 digits: they travel in every prediction.
    """
    image = np.asarray(pixels)
    if image.ndim not in (2, 3) or image.size == 0:
        raise ValueError(f"image_stats needs a 2-D or (channels, h, w) image, got {image.shape}")
    return image_stats_many(image[None])[0]


def image_stats_many(images: npt.NDArray[np.floating]) -> list[dict[str, float]]:
    """:func:`image_stats` of a batch (``(n, h, w)`` or ``(n, channels, h, w)``) at once.

    The agent computes these for every image it scores, beside a model call of a
    fraction of a millisecond: vectorised over the batch, with the percentiles from a
    partial sort (``np.partition``) rather than ``np.percentile``'s full one, and the
    same linear interpolation, so both functions give the same values.
    """
    batch = np.asarray(images)
    if batch.ndim not in (3, 4) or batch.shape[-2] == 0 or batch.shape[-1] == 0:
        raise ValueError(f"image_stats_many needs (n, h, w) or (n, c, h, w), got {images.shape}")
    # Statistics of a drift signal, not of every pixel: an image over MAX_SIDE pixels a
    # side is sampled on a regular grid first (the same grid everywhere, so a reference
    # window and a current one stay comparable), which keeps the cost per image flat.
    step = max(1, -(-max(batch.shape[-2:]) // MAX_SIDE))
    batch = batch[..., ::step, ::step]
    if batch.ndim == 4:
        # Channels averaged on the grid's pixels only (the same values as averaging every
        # pixel first): on a 128 px image the whole-image mean was most of this function.
        batch = batch[:, 0] if batch.shape[1] == 1 else batch.mean(axis=1)
    batch = batch.astype(np.float64)
    n, height, width = batch.shape
    if n == 0:
        return []
    zeros = np.zeros(n)
    dx = np.abs(np.diff(batch, axis=2)).mean(axis=(1, 2)) if width > 1 else zeros
    dy = np.abs(np.diff(batch, axis=1)).mean(axis=(1, 2)) if height > 1 else zeros
    flat = batch.reshape(n, -1)
    p05, p95 = _percentiles(flat, (5.0, 95.0))
    columns = {
        "mean": flat.mean(axis=1),
        "std": flat.std(axis=1),
        "p05": p05,
        "p95": p95,
        "edges": (dx + dy) / 2.0,
    }
    return [{k: round(float(v[i]), 6) for k, v in columns.items()} for i in range(n)]


def _percentiles(
    flat: npt.NDArray[np.float64], qs: tuple[float, ...]
) -> list[npt.NDArray[np.float64]]:
    """Per row, numpy's default ("linear") percentile, from one partial sort per row."""
    size = flat.shape[1]
    positions = [q / 100.0 * (size - 1) for q in qs]
    kth = sorted({k for p in positions for k in (math.floor(p), min(math.floor(p) + 1, size - 1))})
    part = np.partition(flat, kth, axis=1)
    out = []
    for position in positions:
        low = math.floor(position)
        high = min(low + 1, size - 1)
        frac = position - low
        out.append(part[:, low] + (part[:, high] - part[:, low]) * frac)
    return out


def score_features(scores: Mapping[str, float] | npt.NDArray[np.floating]) -> dict[str, float]:
    """Top score, margin to the runner-up, and normalised entropy of one score vector."""
    values = np.asarray(
        list(scores.values()) if isinstance(scores, Mapping) else scores, dtype=np.float64
    ).ravel()
    if values.size == 0:
        raise ValueError("score_features needs at least one score")
    ordered = np.sort(values)[::-1]
    total = float(values.sum())
    probs = values / total if total > 0 else np.full(values.size, 1.0 / values.size)
    nonzero = probs[probs > 0]
    entropy = float(-(nonzero * np.log(nonzero)).sum())
    if values.size > 1:
        entropy /= math.log(values.size)
    return {
        "top": float(ordered[0]),
        "margin": float(ordered[0] - ordered[1]) if values.size > 1 else float(ordered[0]),
        "entropy": entropy,
    }

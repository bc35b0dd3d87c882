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
SCORE_FEATURES = ("top", "margin", "entropy")


def image_stats(pixels: npt.NDArray[np.floating]) -> dict[str, float]:
    """Statistics of one prepared image (``(channels, h, w)`` or ``(h, w)``, any scale).

    ``edges`` is the mean absolute difference between neighbouring pixels, a cheap
    sharpness measure. Values are rounded to 6 digits: they travel in every prediction.
    """
    image = np.asarray(pixels, dtype=np.float64)
    if image.ndim == 3:
        image = image.mean(axis=0)
    if image.ndim != 2 or image.size == 0:
        raise ValueError(f"image_stats needs a 2-D or (channels, h, w) image, got {image.shape}")
    dx = np.abs(np.diff(image, axis=1)).mean() if image.shape[1] > 1 else 0.0
    dy = np.abs(np.diff(image, axis=0)).mean() if image.shape[0] > 1 else 0.0
    p05, p95 = np.percentile(image, [5.0, 95.0])
    values = {
        "mean": float(image.mean()),
        "std": float(image.std()),
        "p05": float(p05),
        "p95": float(p95),
        "edges": float((dx + dy) / 2.0),
    }
    return {k: round(v, 6) for k, v in values.items()}


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

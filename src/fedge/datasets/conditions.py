"""What changes at a station after a model was trained: its lighting and its focus.

The two drifts the demo and the closed-loop tests play out on the generated inspection
images (:mod:`fedge.datasets.defects`): a *lighting drift* (a lamp replaced, daylight through
a new window: the surface brighter and flatter, with a gradient across the part) and a
*defocus* (the camera knocked out of focus: a Gaussian blur, which is what thin
scratches suffer from most). Both keep the labels: the part is as defective as before.

NumPy and Pillow only, deterministic.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageFilter

Images = npt.NDArray[np.uint8]


def lighting_drift(
    images: Images, *, gain: float = 0.5, offset: float = 0.45, gradient: float = 0.2
) -> Images:
    """Brighter, flatter images with a left-to-right gradient (``(n, h, w)`` uint8).

    Pixel ``v`` in [0, 1] becomes ``v * gain + offset + gradient * x`` with ``x`` from
    -0.5 to 0.5 across the image, clipped to [0, 1]. The defaults are the demo's new
    lamp: it costs a CNN trained on the old lighting about 14 points of accuracy.
    """
    if images.ndim != 3:
        raise ValueError(f"lighting_drift needs (n, h, w) images, got {images.shape}")
    width = images.shape[2]
    ramp = np.linspace(-0.5, 0.5, width)[None, None, :] * gradient
    pixels = images.astype(np.float64) / 255.0 * gain + offset + ramp
    return np.round(np.clip(pixels, 0.0, 1.0) * 255.0).astype(np.uint8)


def defocus(images: Images, *, sigma: float = 1.2) -> Images:
    """Each image blurred with a Gaussian of ``sigma`` pixels (``(n, h, w)`` uint8)."""
    if images.ndim != 3:
        raise ValueError(f"defocus needs (n, h, w) images, got {images.shape}")
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    blur = ImageFilter.GaussianBlur(radius=sigma)
    return np.stack([np.asarray(Image.fromarray(image).filter(blur)) for image in images])

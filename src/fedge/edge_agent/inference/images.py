"""Image decoding on the edge: the model's own preprocessing (Pillow + NumPy only)."""

from pathlib import Path

import numpy as np

from fedge.edge_agent.errors import InferenceError
from fedge.party.preprocess import MAX_IMAGE_BYTES, ImageError, prepare
from fedge.protocols.manifest import Preprocess

__all__ = ["MAX_IMAGE_BYTES", "decode_for", "decode_image"]


def decode_for(data: bytes | Path, spec: Preprocess) -> np.ndarray:
    """The model input ``(channels, size, size)`` for one image, as ``spec`` prepares it."""
    try:
        return prepare(data, spec)
    except ImageError as exc:
        raise InferenceError(str(exc)) from None


def decode_image(data: bytes | Path, size: int) -> np.ndarray:
    """Grayscale float32 in [0, 1], ``size`` x ``size`` (a model without a preprocess spec)."""
    image: np.ndarray = decode_for(data, Preprocess(image_size=size))[0]
    return image

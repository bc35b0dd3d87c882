"""Image decoding on the edge (Pillow + NumPy only)."""

import io
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from fedge.edge_agent.errors import InferenceError

MAX_IMAGE_BYTES = 32 * 1024 * 1024


def decode_image(data: bytes | Path, size: int) -> np.ndarray:
    """Grayscale float32 in [0, 1], resized to ``size`` x ``size``."""
    try:
        if isinstance(data, Path):
            if data.stat().st_size > MAX_IMAGE_BYTES:
                raise InferenceError(f"{data} is larger than {MAX_IMAGE_BYTES} bytes")
            image: Image.Image = Image.open(data)
        else:
            if len(data) > MAX_IMAGE_BYTES:
                raise InferenceError(f"image is larger than {MAX_IMAGE_BYTES} bytes")
            image = Image.open(io.BytesIO(data))
        image = image.convert("L")
        if image.size != (size, size):
            image = image.resize((size, size))
        return np.asarray(image, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InferenceError(f"not a readable image: {exc}") from None

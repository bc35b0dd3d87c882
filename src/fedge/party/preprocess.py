"""One way to turn an image file into a model's input, for training and serving alike.

A model's manifest carries its :class:`~fedge.protocols.manifest.Preprocess` (size,
channels, scale, resampling); the agent scoring an image and a station training on the
same file call :func:`prepare` with it, so there is no training/serving skew. Pillow and
NumPy only: the inference-only agent uses this module.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from fedge.party.errors import PartyError
from fedge.protocols.manifest import Preprocess

MAX_IMAGE_BYTES = 32 * 1024 * 1024
# Decoded size bound: a small file can declare a huge image (a "decompression bomb").
MAX_IMAGE_PIXELS = 40_000_000
_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}


class ImageError(PartyError, ValueError):
    """The bytes are not a readable image, or too large (callers translate it).

    Also a ValueError, so code that caught it as one still does.
    """


def prepare(data: bytes | Path, spec: Preprocess) -> npt.NDArray[np.float32]:
    """The model input for one image: float32 ``(channels, size, size)``, pixels * scale."""
    try:
        if isinstance(data, Path):
            if data.stat().st_size > MAX_IMAGE_BYTES:
                raise ImageError(f"{data.name} is larger than {MAX_IMAGE_BYTES} bytes")
            opened: Image.Image = Image.open(data)
        else:
            if len(data) > MAX_IMAGE_BYTES:
                raise ImageError(f"image is larger than {MAX_IMAGE_BYTES} bytes")
            opened = Image.open(io.BytesIO(data))
        with opened:
            width, height = opened.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageError(
                    f"image of {width}x{height} pixels is over {MAX_IMAGE_PIXELS} pixels"
                )
            if opened.format == "JPEG":  # decode at a reduced scale when that is enough
                opened.draft("L" if spec.channels == 1 else "RGB", (spec.image_size,) * 2)
            image = opened.convert("L" if spec.channels == 1 else "RGB")
        if image.size != (spec.image_size, spec.image_size):
            image = image.resize((spec.image_size, spec.image_size), _RESAMPLE[spec.resample])
        pixels = np.asarray(image, dtype=np.float32) * np.float32(spec.scale)
    except UnidentifiedImageError:
        # Pillow's message names its file object (``<_io.BytesIO object at 0x...>``).
        name = data.name if isinstance(data, Path) else "the image"
        raise ImageError(
            f"{name} is not a readable image (expected PNG, JPEG, BMP or PGM)"
        ) from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError(f"not a readable image: {exc}") from None
    if spec.channels == 1:
        return pixels[None, :, :]
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def prepare_many(paths: list[Path], spec: Preprocess) -> npt.NDArray[np.float32]:
    """A batch ``(n, channels, size, size)``; raises ImageError naming the first bad file."""
    batch = np.empty((len(paths), spec.channels, spec.image_size, spec.image_size), np.float32)
    for index, path in enumerate(paths):
        batch[index] = prepare(path, spec)
    return batch

"""Image thumbnails a station may share with the console: the policy and the record.

Station images stay on the station by default (PRODUCT.md, "privacy by default"). An
operator who wants to see what a line rejects can make one station share small PNG
thumbnails of the images it scores: :class:`ThumbnailPolicy` in that station's signed
config. Without it an agent makes none and the manager stores none it is sent.

A thumbnail travels as a :class:`ThumbnailRecord` on its own record stream (``up/
thumbnails``), so it rides the outbox like every other record (numbered batches, stored
once) while its bounds keep a batch well under the codec's 256 KiB: at most
:data:`MAX_PNG_BYTES` of PNG each, :data:`PER_BATCH` per batch. The PNG is checked here
(signature, a well-formed IHDR, its size) so that neither the manager nor the browser
ever sees an image larger than the policy allows.
"""

import base64
import binascii
import struct
from dataclasses import dataclass

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError

MIN_SIDE = 16
MAX_SIDE = 96
MAX_PNG_BYTES = 12 * 1024
# 12 thumbnails of 12 KiB as base64 are ~197 KiB: a batch stays under the codec's limit.
PER_BATCH = 12
MAX_PER_MINUTE = 600
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class ThumbnailPolicy:
    """A station shares thumbnails of what it scores (present in its config: sharing on).

    ``size`` is the longest side in pixels; ``rejects_only`` shares only the images the
    station rejected (what an operator reviews); ``per_minute`` caps how many a station
    sends, so a line running flat out does not turn into an image upload.
    """

    size: int = 64
    rejects_only: bool = True
    per_minute: int = 30

    def __post_init__(self) -> None:
        if not MIN_SIDE <= self.size <= MAX_SIDE:
            raise ValidationError(
                f"thumbnails.size must be in [{MIN_SIDE}, {MAX_SIDE}], got {self.size}"
            )
        if not 1 <= self.per_minute <= MAX_PER_MINUTE:
            raise ValidationError(
                f"thumbnails.per_minute must be in [1, {MAX_PER_MINUTE}], got {self.per_minute}"
            )


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header; ValidationError if it is not a PNG."""
    # The signature, then the IHDR chunk: length 13, type, width and height (big-endian).
    if len(data) < 33 or not data.startswith(PNG_SIGNATURE):
        raise ValidationError("thumbnail is not a PNG image")
    length, kind, width, height = struct.unpack(">I4sII", data[8:24])
    if length != 13 or kind != b"IHDR":
        raise ValidationError("thumbnail PNG has no IHDR header")
    return width, height


def check_png(data: bytes) -> tuple[int, int]:
    """A thumbnail's PNG within bounds: its (width, height), or ValidationError."""
    if len(data) > MAX_PNG_BYTES:
        raise ValidationError(f"thumbnail is {len(data)} bytes, limit {MAX_PNG_BYTES}")
    width, height = png_size(data)
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise ValidationError(f"thumbnail is {width}x{height} pixels, limit {MAX_SIDE}x{MAX_SIDE}")
    return width, height


@dataclass(frozen=True)
class ThumbnailRecord:
    """A thumbnail of the image a prediction scored: PNG, base64 on the wire."""

    prediction_id: str
    at: float
    png: str

    def __post_init__(self) -> None:
        validate.identifier(self.prediction_id, "prediction_id")
        validate.finite(self.at, "at", minimum=0.0)
        # Bounded before decoding: base64 of MAX_PNG_BYTES is at most this long.
        if len(self.png) > 4 * (MAX_PNG_BYTES // 3 + 1):
            raise ValidationError(f"thumbnail is over {MAX_PNG_BYTES} bytes")
        check_png(self.image())

    def image(self) -> bytes:
        try:
            return base64.b64decode(self.png, validate=True)
        except (binascii.Error, ValueError):
            raise ValidationError("thumbnail is not valid base64") from None

    @classmethod
    def of(cls, prediction_id: str, at: float, png: bytes) -> "ThumbnailRecord":
        return cls(prediction_id, at, base64.b64encode(png).decode("ascii"))

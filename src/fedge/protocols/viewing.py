"""Operators viewing a station's images on demand (issue 30, item 3): the contract.

A station keeps the images it scored (its training set); they never leave it unless its
signed config says ``operator_viewing`` (protocols/config.py, off by default, set by an
admin). Then the console asks for one image at a time, through the manager, over the
fleet's mutual TLS:

    console (browser) -> manager (its fleet client certificate, role manager)
        -> GET https://{images_at}/v1/images/{prediction_id} on the station's agent

The agent serves only a manager's certificate from its fleet CA, and decides from its own
signed copy of the config, so a manager that was wrong (or lied) about the policy still
gets nothing. The manager relays the bytes to the browser and keeps none of them. The
station says where it serves images in its birth (``Liveness.images_at``).

A refusal is a status and a reason word (:class:`Refusal`), so the manager can tell the
operator which one it was: the policy is off, the prediction is unknown, its image was
pruned by retention, or it is over :data:`MAX_IMAGE_BYTES`.
"""

from enum import StrEnum

from fedge.protocols.errors import ValidationError

IMAGE_PATH = "/v1/images/"
# A kept image is at most this large when served (the agent refuses a larger one, the
# manager refuses a larger reply): far above an inspection camera's frame as PNG/JPEG.
MAX_IMAGE_BYTES = 8 * 2**20
REASON_HEADER = "X-Fedge-Refusal"
MEDIA_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".bmp": "image/bmp",
    ".pgm": "image/x-portable-graymap",
}


class Refusal(StrEnum):
    """Why a station sent no image (its HTTP status in :data:`STATUS`)."""

    POLICY_OFF = "policy_off"  # its signed config does not allow operator viewing
    UNKNOWN = "unknown"  # no such prediction on the station
    PRUNED = "pruned"  # scored there, but retention has removed its image since
    TOO_LARGE = "too_large"  # over MAX_IMAGE_BYTES
    NOT_MANAGER = "not_manager"  # the caller's certificate is not the manager's
    REVOKED = "revoked"  # the fleet's CRL at the station revokes the caller's certificate
    BAD_REQUEST = "bad_request"


STATUS = {
    Refusal.POLICY_OFF: 403,
    Refusal.UNKNOWN: 404,
    Refusal.PRUNED: 410,
    Refusal.TOO_LARGE: 413,
    Refusal.NOT_MANAGER: 403,
    Refusal.REVOKED: 403,
    Refusal.BAD_REQUEST: 400,
}


def check_address(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) where a station serves its images, split."""
    host, sep, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if (
        not sep
        or not host
        or len(value) > 255
        or not (port.isascii() and port.isdigit())
        or not 0 < int(port) < 65536
        or any(c.isspace() or c in "/?#@" for c in host)
    ):
        raise ValidationError(f"images_at must be host:port, got {value[:80]!r}")
    return host, int(port)

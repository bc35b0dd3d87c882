"""Small checks shared by the message dataclasses' ``__post_init__``."""

import math
import re
from collections.abc import Mapping

from fedge.protocols.errors import ValidationError

# Identifiers become MQTT topic levels and file names: no wildcards, separators or `$`.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
U64_MAX = 2**64 - 1

OMIT_KEY = "omit_when_none"
OMIT_WHEN_NONE = {OMIT_KEY: True}
"""Field metadata for an optional extension: left out of the wire form while it is None.

Decoding is strict (an unknown field is an error), so a field added after agents were
installed must not appear in messages that do not use it: an older agent keeps decoding
every message that does not need the new capability.
"""


def identifier(value: str, what: str) -> None:
    if not _ID.fullmatch(value):
        raise ValidationError(
            f"{what} {value!r} is not a valid identifier "
            "(1-64 chars of letters, digits, '_', '.', '-'; starting with a letter or digit)"
        )


def sha256_hex(value: str, what: str = "sha256") -> None:
    if not _SHA256.fullmatch(value):
        raise ValidationError(f"{what} must be 64 lowercase hex digits, got {value!r}")


def probability(value: float, what: str) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValidationError(f"{what} must be in [0, 1], got {value!r}")


def finite(value: float, what: str, *, minimum: float | None = None) -> None:
    if not math.isfinite(value):
        raise ValidationError(f"{what} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValidationError(f"{what} must be >= {minimum}, got {value!r}")


def u64(value: int, what: str) -> None:
    if not 0 <= value <= U64_MAX:
        raise ValidationError(f"{what} must be in [0, 2^64-1], got {value!r}")


def positive(value: int, what: str) -> None:
    if not 1 <= value <= U64_MAX:
        raise ValidationError(f"{what} must be in [1, 2^64-1], got {value!r}")


def bounded_text(value: str, what: str, limit: int = 256) -> None:
    if len(value) > limit:
        raise ValidationError(f"{what} is {len(value)} chars, limit {limit}")


def probability_map(values: Mapping[str, float], what: str) -> None:
    for key, value in values.items():
        identifier(key, f"{what} key")
        probability(value, f"{what}[{key!r}]")

"""Whether the station sends one of its kept images: a pure decision over plain facts.

The station decides from its own signed config (protocols/viewing.py): whatever the
manager believes, an image leaves only while ``operator_viewing`` is on in the config the
agent applied, and only to the manager's certificate, unless the fleet's CRL at the
station revokes it (edge_agent/identity/crl.py). The order of the checks matters:
a caller that may not see images learns nothing about which predictions exist.
"""

from dataclasses import dataclass

from fedge.protocols.config import EdgeConfig
from fedge.protocols.pki import Role
from fedge.protocols.viewing import MAX_IMAGE_BYTES, Refusal


@dataclass(frozen=True)
class ImageFacts:
    """What the station knows when asked for a prediction's image."""

    caller: Role | None  # the role in the client certificate TLS verified
    revoked: bool  # the station's CRL revokes that certificate (or cannot be checked)
    viewing_on: bool  # the applied signed config allows operator viewing
    known: bool  # the station scored this prediction (its own store has it)
    kept_bytes: int | None  # the kept image's size; None: never kept, or pruned


def viewing_on(config: EdgeConfig | None) -> bool:
    """Whether the config in force allows operators to view images (off without one)."""
    return config is not None and config.operator_viewing is True


def decide(facts: ImageFacts) -> Refusal | None:
    """None: send the image; else why not."""
    if facts.revoked:
        return Refusal.REVOKED
    if facts.caller is not Role.MANAGER:
        return Refusal.NOT_MANAGER
    if not facts.viewing_on:
        return Refusal.POLICY_OFF
    if not facts.known:
        return Refusal.UNKNOWN
    if facts.kept_bytes is None:
        return Refusal.PRUNED
    if facts.kept_bytes > MAX_IMAGE_BYTES:
        return Refusal.TOO_LARGE
    return None

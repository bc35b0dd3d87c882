"""Rotating the manager's signing key: what travels down to the edges and back up (issue 13).

Agents pin the manager's Ed25519 key (signing.py). To replace it without touching each
station, the manager makes a :class:`KeyRotation` naming the current key and the next,
with exactly the next sequence number, signed by *both* keys and, when the fleet has an
offline root key, by that too (issue 24; rotation.py). A chain of rotations, oldest
first, goes down every edge's retained ``down/trust`` topic as a :class:`TrustChain`,
signed as a whole by the key it ends at, with an expiry. An edge follows the chain from
the key it pins, one verified link at a time, and from then on trusts only the newest key
-- the pattern of TUF's root rotation (Samuel et al., "Survivable Key Compromise in
Software Update Systems", CCS 2010): each new root signed by the old and the new keys,
versions that increase by exactly one, metadata that expires.

Each edge states the key it trusts, and any chain it refused, on ``up/trust``
(:class:`TrustReport`) so the manager can show how far a rotation has reached.
"""

from dataclasses import dataclass, field
from enum import StrEnum

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError

# One rotation a week for a year is 52 links; a chain this long is a bug or an attack.
MAX_LINKS = 256
MAX_LINK_CHARS = 2048  # a link with three signatures is about 700
_KEY_ID_CHARS = 16


@dataclass(frozen=True)
class KeyRotation:
    """The statement that ``new_key`` signs for ``fleet`` from now on instead of
    ``old_key``: valid only with the signatures of both (and of the fleet's root key,
    where a station pins one), over these exact bytes (rotation.py)."""

    fleet: str
    sequence: int  # 1 for the first rotation of a fleet, then exactly +1 each time
    old_key: str  # base64 raw Ed25519 public key (signing.PublicKey.to_text)
    new_key: str
    issued_at: float

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        validate.positive(self.sequence, "rotation sequence")
        validate.bounded_text(self.old_key, "old key", 64)
        validate.bounded_text(self.new_key, "new key", 64)
        validate.finite(self.issued_at, "issued_at", minimum=0.0)


@dataclass(frozen=True)
class TrustChain:
    """Every rotation of a fleet's key so far, as co-signed links, oldest first; sent down
    inside an envelope signed by the key the chain ends at, which vouches for
    ``expires_at`` (a chain replayed after that is refused, freshness.py)."""

    fleet: str
    links: tuple[str, ...]
    # Optional on the wire; the manager always sets it (freshness.LIFETIME_S ahead).
    expires_at: float | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        if self.expires_at is not None:
            validate.finite(self.expires_at, "expires_at", minimum=0.0)
        if not 1 <= len(self.links) <= MAX_LINKS:
            raise ValidationError(
                f"a trust chain has 1 to {MAX_LINKS} links, not {len(self.links)}"
            )
        for link in self.links:
            validate.bounded_text(link, "trust chain link", MAX_LINK_CHARS)


class TrustStatus(StrEnum):
    CURRENT = "current"  # the edge already trusts the chain's newest key
    ADOPTED = "adopted"  # it followed the chain to a new key
    REJECTED = "rejected"  # the chain does not lead from its key: nothing changed


@dataclass(frozen=True)
class TrustReport:
    edge: str
    status: TrustStatus
    key_id: str  # the key the edge trusts after this chain
    sequence: int  # that key's place in the fleet's chain (0: the key it was enrolled with)
    reason: str
    at: float
    # Set while the station's signed desired state has not been refreshed for longer than
    # it allows (a freeze attack, or a manager that stopped): when it last was.
    stale_since: float | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.edge, "edge")
        if self.stale_since is not None:
            validate.finite(self.stale_since, "stale_since", minimum=0.0)
        if len(self.key_id) != _KEY_ID_CHARS or not all(
            c in "0123456789abcdef" for c in self.key_id
        ):
            raise ValidationError(f"key_id must be {_KEY_ID_CHARS} lowercase hex characters")
        validate.u64(self.sequence, "sequence")
        validate.bounded_text(self.reason, "reason", 1000)
        validate.finite(self.at, "at", minimum=0.0)

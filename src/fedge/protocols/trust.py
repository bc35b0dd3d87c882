"""Rotating the manager's signing key: what travels down to the edges and back up (issue 13).

Agents pin the manager's Ed25519 key (signing.py). To replace it without touching each
station, the manager signs a :class:`KeyRotation` naming the next key *with the current
one*; a chain of rotations, oldest first, goes down every edge's retained ``down/trust``
topic as a :class:`TrustChain`. An edge follows the chain from the key it pins, one
verified link at a time (rotation.py), and from then on trusts only the newest key --
the pattern of TUF's root rotation (Samuel et al., "Survivable Key Compromise in Software
Update Systems", CCS 2010), where each new root is signed by the previous one.

Each edge states the key it trusts, and any chain it refused, on ``up/trust``
(:class:`TrustReport`) so the manager can show how far a rotation has reached.
"""

from dataclasses import dataclass
from enum import StrEnum

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError

# One rotation a week for a year is 52 links; a chain this long is a bug or an attack.
MAX_LINKS = 256
MAX_LINK_CHARS = 2048
_KEY_ID_CHARS = 16


@dataclass(frozen=True)
class KeyRotation:
    """The outgoing key's statement that ``new_key`` signs for ``fleet`` from now on."""

    fleet: str
    sequence: int  # 1 for the first rotation of a fleet, then +1 each time
    new_key: str  # base64 raw Ed25519 public key (signing.PublicKey.to_text)
    issued_at: float

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        validate.positive(self.sequence, "rotation sequence")
        validate.bounded_text(self.new_key, "new key", 64)
        validate.finite(self.issued_at, "issued_at", minimum=0.0)


@dataclass(frozen=True)
class TrustChain:
    """Every rotation of a fleet's key so far, as signed envelopes, oldest first."""

    fleet: str
    links: tuple[str, ...]

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
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

    def __post_init__(self) -> None:
        validate.identifier(self.edge, "edge")
        if len(self.key_id) != _KEY_ID_CHARS or not all(
            c in "0123456789abcdef" for c in self.key_id
        ):
            raise ValidationError(f"key_id must be {_KEY_ID_CHARS} lowercase hex characters")
        validate.u64(self.sequence, "sequence")
        validate.bounded_text(self.reason, "reason", 1000)
        validate.finite(self.at, "at", minimum=0.0)

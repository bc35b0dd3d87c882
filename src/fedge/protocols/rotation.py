"""Following a trust chain: the pure decision an edge makes on ``down/trust`` (trust.py).

An edge starts from the key it pins (sequence 0 when that is the key it was enrolled
with). It walks the chain oldest first; a link counts only if the key it trusts *at that
point* signed it, for this fleet, with a higher sequence and a different key. Links signed
by keys it never trusted are history from before its enrollment and are passed over. The
chain must end at the key the walk reached: a chain that ends anywhere else -- a forged
link, a key the edge cannot reach -- is refused as a whole and nothing changes.
"""

from dataclasses import dataclass

from fedge.protocols.errors import ProtocolError
from fedge.protocols.signing import (
    PublicKey,
    SigningKey,
    open_signed,
    signer_of,
    trusted,
    unverified_payload,
)
from fedge.protocols.trust import KeyRotation, TrustChain, TrustStatus


@dataclass(frozen=True)
class Trust:
    """The key an edge accepts signatures from, and its place in the fleet's chain."""

    key: PublicKey
    sequence: int = 0


@dataclass(frozen=True)
class TrustDecision:
    status: TrustStatus
    trust: Trust  # what the edge trusts afterwards (unchanged unless ADOPTED)
    reason: str = ""
    adopted: tuple[int, ...] = ()  # the sequences it followed, in order


def rotation_link(
    old: SigningKey, new: PublicKey, *, fleet: str, sequence: int, issued_at: float
) -> str:
    """The outgoing key's signed statement that ``new`` takes over at ``sequence``."""
    return old.sign(KeyRotation(fleet, sequence, new.to_text(), issued_at)).decode()


def follow(trust: Trust, chain: TrustChain, fleet: str) -> TrustDecision:
    def refuse(reason: str) -> TrustDecision:
        return TrustDecision(TrustStatus.REJECTED, trust, reason)

    if chain.fleet != fleet:
        return refuse(f"the chain is for fleet {chain.fleet!r}, this edge is in {fleet!r}")
    current, adopted = trust, []
    for number, link in enumerate(chain.links, start=1):
        try:
            signer = signer_of(link.encode())
        except ProtocolError as exc:
            return refuse(f"link {number} is not a signed envelope: {exc}")
        if signer != current.key.key_id:
            continue  # signed by a key from before this edge's (judged at the end)
        try:
            rotation = open_signed(link.encode(), KeyRotation, trusted(current.key))
            new = PublicKey.from_text(rotation.new_key)
        except ProtocolError as exc:
            return refuse(f"link {number} names key {signer} but does not verify: {exc}")
        if rotation.fleet != fleet:
            return refuse(f"link {number} rotates fleet {rotation.fleet!r}, not {fleet!r}")
        if rotation.sequence <= current.sequence:
            return refuse(
                f"link {number} has sequence {rotation.sequence}, not above {current.sequence} "
                "(a replayed rotation)"
            )
        if new == current.key:
            return refuse(f"link {number} rotates key {signer} to itself")
        current = Trust(new, rotation.sequence)
        adopted.append(rotation.sequence)
    try:
        last = unverified_payload(chain.links[-1].encode(), KeyRotation)
    except ProtocolError as exc:
        return refuse(f"the last link is not a key rotation: {exc}")
    if last.new_key != current.key.to_text():
        if not adopted and last.sequence < trust.sequence:
            return TrustDecision(
                TrustStatus.CURRENT,
                trust,
                f"an older chain (it ends at sequence {last.sequence}, this edge is at "
                f"{trust.sequence}); ignored",
            )
        return refuse(
            f"the chain ends at sequence {last.sequence} with a key that the trusted key "
            f"{trust.key.key_id} does not lead to (a forged or foreign rotation)"
        )
    # An edge enrolled with the newest key learns its place in the chain here.
    final = Trust(current.key, max(current.sequence, last.sequence))
    if not adopted:
        return TrustDecision(TrustStatus.CURRENT, final)
    return TrustDecision(TrustStatus.ADOPTED, final, "", tuple(adopted))

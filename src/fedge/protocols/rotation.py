"""Following a trust chain: the pure decision an edge makes on ``down/trust`` (trust.py).

A rotation link is co-signed, as TUF rotates its root (issue 24): one payload, the
:class:`KeyRotation`, and the signatures of the outgoing key, the incoming key and, when
the fleet has an offline root key, the root key, all over the same bytes::

    {"schema": 1, "kind": "cosigned", "payload": "<json>", "sigs": {"<key id>": "<b64>"}}

An edge starts from the key it pins (sequence 0 when that is the key it was enrolled
with). It walks the chain oldest first; a link counts only if it rotates away from the
key it trusts *at that point*, for this fleet, with exactly the next sequence, and carries
valid signatures by that key, by the new key, and by the root key the edge pinned (if
any). Links from other keys are history from before its enrollment and are passed over
(the one that introduced its own key tells it its place in the sequence). The chain must
end at the key the walk reached: a chain that ends anywhere else -- a forged link, a key
the edge cannot reach -- is refused as a whole and nothing changes.

The chain itself travels signed by the key it ends at, with an expiry
(:func:`accept_chain`): a replayed old chain is refused once expired.

What co-signing buys, and what it does not: the new key's signature proves the rotation's
author holds the new private key (no rotation to a key nobody controls, or to someone
else's public key). It does not stop a thief holding the current signing key, who can make
a key and co-sign with it. Only the offline root key does: with a root pinned, a rotation
needs a key that never is on the manager.
"""

import base64
import json
from dataclasses import dataclass

from fedge.protocols import codec
from fedge.protocols.errors import DecodeError, ProtocolError, SignatureError
from fedge.protocols.freshness import check_not_expired
from fedge.protocols.signing import (
    MAX_ENVELOPE_BYTES,
    PublicKey,
    SigningKey,
    signature_valid,
    trusted,
    unverified_payload,
    verify_envelope,
)
from fedge.protocols.trust import KeyRotation, TrustChain, TrustStatus

_COSIGNED = "cosigned"
_MAX_SIGNATURES = 8


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
    expires_at: float | None = None  # the accepted chain's expiry (accept_chain)


# -- co-signed links


@dataclass(frozen=True)
class CosignedLink:
    rotation: KeyRotation
    payload: bytes  # the exact bytes every signature covers
    signatures: dict[str, str]  # key id -> base64 signature

    def signed_by(self, key: PublicKey) -> bool:
        sig = self.signatures.get(key.key_id)
        return sig is not None and signature_valid(key, self.payload, sig)


def _encode_link(payload: bytes, signatures: dict[str, str]) -> str:
    obj = {
        "schema": codec.SCHEMA_VERSION,
        "kind": _COSIGNED,
        "payload": payload.decode(),
        "sigs": dict(sorted(signatures.items())),
    }
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def parse_link(link: str) -> CosignedLink:
    """A link's rotation and signatures, nothing verified (DecodeError if malformed)."""
    obj = codec.loads(link.encode(), max_bytes=MAX_ENVELOPE_BYTES)
    if type(obj) is not dict or obj.get("kind") != _COSIGNED:
        raise DecodeError(
            "not a co-signed key rotation (kind 'cosigned' expected; a link signed by the "
            "old key alone is refused since issue 24)"
        )
    if set(obj) != {"schema", "kind", "payload", "sigs"} or obj["schema"] != codec.SCHEMA_VERSION:
        raise DecodeError(f"co-signed link fields {sorted(obj)} or schema are not expected")
    payload, sigs = obj["payload"], obj["sigs"]
    if type(payload) is not str or type(sigs) is not dict or len(sigs) > _MAX_SIGNATURES:
        raise DecodeError(f"a co-signed link has a text payload and 1 to {_MAX_SIGNATURES} sigs")
    if not all(type(k) is str and type(v) is str for k, v in sigs.items()):
        raise DecodeError("co-signed link signatures must be text")
    data = payload.encode()
    return CosignedLink(codec.decode(data, KeyRotation), data, dict(sigs))


def add_signature(link: str, key: SigningKey) -> str:
    """``link`` with ``key``'s signature added over the same bytes (the offline root
    key's step, or any co-signer's)."""
    parsed = parse_link(link)
    signature = base64.b64encode(key.sign_bytes(parsed.payload)).decode()
    return _encode_link(parsed.payload, {**parsed.signatures, key.public.key_id: signature})


def rotation_link(
    old: SigningKey,
    new: SigningKey,
    *,
    fleet: str,
    sequence: int,
    issued_at: float,
    root: SigningKey | None = None,
) -> str:
    """The statement that ``new`` takes over from ``old`` at ``sequence``, signed by both
    (and by ``root``, for a fleet whose stations pin a root key)."""
    rotation = KeyRotation(fleet, sequence, old.public.to_text(), new.public.to_text(), issued_at)
    link = _encode_link(codec.encode(rotation), {})
    for key in (old, new) if root is None else (old, new, root):
        link = add_signature(link, key)
    return link


def missing_signatures(
    link: CosignedLink, old: PublicKey, new: PublicKey, root: PublicKey | None
) -> list[str]:
    """Which of the required signers did not (validly) sign ``link``."""
    required = [("old", old), ("new", new)] + ([("root", root)] if root is not None else [])
    return [f"the {name} key {key.key_id}" for name, key in required if not link.signed_by(key)]


# -- following a chain


def follow(
    trust: Trust, chain: TrustChain, fleet: str, *, root: PublicKey | None = None
) -> TrustDecision:
    def refuse(reason: str) -> TrustDecision:
        return TrustDecision(TrustStatus.REJECTED, trust, reason)

    if chain.fleet != fleet:
        return refuse(f"the chain is for fleet {chain.fleet!r}, this edge is in {fleet!r}")
    current, adopted = trust, []
    parsed: CosignedLink | None = None
    for number, link in enumerate(chain.links, start=1):
        try:
            parsed = parse_link(link)
        except ProtocolError as exc:
            return refuse(f"link {number} is not a co-signed key rotation: {exc}")
        rotation = parsed.rotation
        if rotation.old_key != current.key.to_text():
            if rotation.new_key == current.key.to_text() and current.sequence == 0:
                # The rotation that introduced the key this edge was enrolled with: its
                # place in the sequence (a wrong one can only make it refuse the next).
                current = Trust(current.key, rotation.sequence)
            continue  # from before this edge's key (judged at the end)
        try:
            new = PublicKey.from_text(rotation.new_key)
        except ProtocolError as exc:
            return refuse(f"link {number} names a new key that is not one: {exc}")
        if rotation.fleet != fleet:
            return refuse(f"link {number} rotates fleet {rotation.fleet!r}, not {fleet!r}")
        if new == current.key:
            return refuse(f"link {number} rotates key {current.key.key_id} to itself")
        missing = missing_signatures(parsed, current.key, new, root)
        if missing:
            return refuse(
                f"link {number} ({current.key.key_id} -> {new.key_id}) does not verify: no "
                f"valid signature by {' or '.join(missing)} (a rotation needs the old and "
                "the new key" + (", and the fleet's root key" if root is not None else "") + ")"
            )
        if rotation.sequence <= current.sequence:
            return refuse(
                f"link {number} has sequence {rotation.sequence}, not above {current.sequence} "
                "(a replayed rotation)"
            )
        if rotation.sequence != current.sequence + 1:
            return refuse(
                f"link {number} has sequence {rotation.sequence}; the next is "
                f"{current.sequence + 1} (a rotation skipped)"
            )
        current = Trust(new, rotation.sequence)
        adopted.append(rotation.sequence)
    last = parsed.rotation if parsed is not None else None
    if last is None:  # TrustChain has at least one link; kept for the type checker
        return refuse("the chain has no links")
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


def sign_chain(key: SigningKey, chain: TrustChain) -> bytes:
    """The ``down/trust`` document: the chain signed by the key it ends at."""
    return key.sign(chain)


def accept_chain(
    trust: Trust, envelope: bytes, fleet: str, *, root: PublicKey | None, now: float
) -> TrustDecision:
    """:func:`follow` a ``down/trust`` document, then require it signed as a whole by the
    key it leads to and not expired."""
    try:
        chain = unverified_payload(envelope, TrustChain)
    except ProtocolError as exc:
        return TrustDecision(
            TrustStatus.REJECTED, trust, f"not a signed trust chain ({exc.reason}): {exc}"
        )
    decision = follow(trust, chain, fleet, root=root)
    if decision.status is TrustStatus.REJECTED or decision.reason:
        return decision  # refused, or an older chain ignored as before
    try:
        verify_envelope(envelope, trusted(decision.trust.key))
        check_not_expired("the trust chain", chain.expires_at, now)
    except SignatureError as exc:
        reason = f"the chain is not signed by the key it leads to: {exc}"
        return TrustDecision(TrustStatus.REJECTED, trust, reason)
    except ProtocolError as exc:
        return TrustDecision(TrustStatus.REJECTED, trust, str(exc))
    return TrustDecision(
        decision.status, decision.trust, decision.reason, decision.adopted, chain.expires_at
    )

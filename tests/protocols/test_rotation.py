"""Following the fleet's key rotations: the pure decision (protocols/rotation.py)."""

import json

import pytest

from fedge.protocols import codec
from fedge.protocols.errors import ValidationError
from fedge.protocols.rotation import Trust, follow, rotation_link
from fedge.protocols.signing import KeyRing, SigningKey
from fedge.protocols.trust import KeyRotation, TrustChain, TrustStatus

FLEET = "plant-a"
K0, K1, K2 = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()


def link(old: SigningKey, new: SigningKey, sequence: int, fleet: str = FLEET) -> str:
    return rotation_link(old, new.public, fleet=fleet, sequence=sequence, issued_at=1.0)


def chain(*links: str, fleet: str = FLEET) -> TrustChain:
    return TrustChain(fleet, links)


L1, L2 = link(K0, K1, 1), link(K1, K2, 2)


def test_an_edge_follows_one_rotation_signed_by_the_key_it_pins() -> None:
    decision = follow(Trust(K0.public), chain(L1), FLEET)
    assert decision.status is TrustStatus.ADOPTED
    assert decision.trust == Trust(K1.public, 1)
    assert decision.adopted == (1,)


def test_an_edge_offline_through_two_rotations_follows_both() -> None:
    decision = follow(Trust(K0.public), chain(L1, L2), FLEET)
    assert decision.status is TrustStatus.ADOPTED
    assert decision.trust == Trust(K2.public, 2)
    assert decision.adopted == (1, 2)


def test_an_edge_enrolled_with_the_newest_key_passes_over_older_links() -> None:
    decision = follow(Trust(K2.public), chain(L1, L2), FLEET)
    assert decision.status is TrustStatus.CURRENT
    assert decision.trust == Trust(K2.public, 2)  # learns its place in the chain
    later = follow(Trust(K1.public), chain(L1, L2), FLEET)
    assert later.status is TrustStatus.ADOPTED and later.adopted == (2,)


def test_the_chain_it_already_followed_changes_nothing() -> None:
    decision = follow(Trust(K1.public, 1), chain(L1), FLEET)
    assert decision.status is TrustStatus.CURRENT
    assert decision.trust == Trust(K1.public, 1)


def test_an_older_chain_is_ignored_not_refused() -> None:
    decision = follow(Trust(K2.public, 2), chain(L1), FLEET)
    assert decision.status is TrustStatus.CURRENT
    assert decision.trust == Trust(K2.public, 2)
    assert "older chain" in decision.reason


FORGER = SigningKey.generate()


@pytest.mark.parametrize(
    ("links", "fleet", "says"),
    [
        # The attacker signs a rotation to its own key with its own key.
        ((link(FORGER, FORGER, 1),), FLEET, "does not lead to"),
        ((link(FORGER, K2, 1),), FLEET, "does not lead to"),
        # A valid first step, then a forged second: refused as a whole.
        ((L1, link(FORGER, FORGER, 2)), FLEET, "does not lead to"),
        # An edge of another fleet's rotation (signed by this key: a key reused).
        ((link(K0, K1, 1, fleet="plant-b"),), FLEET, "rotates fleet 'plant-b'"),
        ((L1,), "plant-b", "for fleet 'plant-b'"),
        # Sequence 0 is not a rotation; a replay of an old number is refused.
        ((link(K0, K1, 1), link(K1, K2, 1)), FLEET, "replayed"),
        ((link(K0, K0, 1),), FLEET, "to itself"),
        (("not an envelope",), FLEET, "not a signed envelope"),
    ],
)
def test_forged_chains_are_refused_and_change_nothing(
    links: tuple[str, ...], fleet: str, says: str
) -> None:
    trust = Trust(K0.public)
    decision = follow(trust, TrustChain(fleet, links), FLEET)
    assert decision.status is TrustStatus.REJECTED
    assert decision.trust == trust
    assert says in decision.reason
    assert decision.adopted == ()


def test_a_link_naming_the_pinned_key_with_a_bad_signature_is_refused() -> None:
    envelope = codec.loads(L1.encode())
    assert isinstance(envelope, dict)
    forged_payload = codec.encode(KeyRotation(FLEET, 1, FORGER.public.to_text(), 1.0)).decode()
    tampered = dict(envelope, payload=forged_payload)  # K0's key_id and signature kept
    decision = follow(Trust(K0.public), chain(json.dumps(tampered)), FLEET)
    assert decision.status is TrustStatus.REJECTED
    assert "does not verify" in decision.reason


def test_a_chain_has_bounds() -> None:
    with pytest.raises(ValidationError):
        TrustChain(FLEET, ())
    with pytest.raises(ValidationError):
        TrustChain(FLEET, ("x" * 5000,))
    with pytest.raises(ValidationError):
        KeyRotation(FLEET, 0, K1.public.to_text(), 1.0)


def test_a_key_ring_replaced_trusts_only_the_new_key_and_remembers_the_old() -> None:
    ring = KeyRing(K0.public)
    ring.replace(K1.public)
    assert set(ring) == {K1.public.key_id}
    assert ring.retired == {K0.public.key_id}
    ring.replace(K1.public)  # idempotent
    assert set(ring) == {K1.public.key_id} and ring.retired == {K0.public.key_id}

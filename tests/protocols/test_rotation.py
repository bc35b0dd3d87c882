"""Following the fleet's key rotations: the pure decision (protocols/rotation.py), and
the expiry of signed documents (protocols/freshness.py)."""

import json

import pytest

from fedge.protocols import codec
from fedge.protocols.errors import ExpiredError, ValidationError
from fedge.protocols.freshness import (
    LIFETIME_S,
    check_not_expired,
    expiry,
    needs_refresh,
    staleness,
)
from fedge.protocols.rotation import (
    Trust,
    accept_chain,
    add_signature,
    follow,
    parse_link,
    rotation_link,
    sign_chain,
)
from fedge.protocols.signing import KeyRing, SigningKey
from fedge.protocols.trust import KeyRotation, TrustChain, TrustStatus

FLEET = "plant-a"
K0, K1, K2 = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()


def link(
    old: SigningKey,
    new: SigningKey,
    sequence: int,
    fleet: str = FLEET,
    root: SigningKey | None = None,
) -> str:
    return rotation_link(old, new, fleet=fleet, sequence=sequence, issued_at=1.0, root=root)


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
        # Sequence 0 is not a rotation; a replay of an old number is refused, and so is
        # a jump (every rotation is seen, as TUF's root versions: exactly +1).
        ((link(K0, K1, 1), link(K1, K2, 1)), FLEET, "replayed"),
        ((link(K0, K1, 2),), FLEET, "skipped"),
        ((L1, link(K1, K2, 3)), FLEET, "skipped"),
        ((link(K0, K0, 1),), FLEET, "to itself"),
        (("not an envelope",), FLEET, "not a co-signed key rotation"),
        # The format before issue 24: one envelope signed by the old key alone.
        (
            (
                K0.sign(
                    KeyRotation(FLEET, 1, K0.public.to_text(), K1.public.to_text(), 1.0)
                ).decode(),
            ),
            FLEET,
            "not a co-signed key rotation",
        ),
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
    forged = KeyRotation(FLEET, 1, K0.public.to_text(), FORGER.public.to_text(), 1.0)
    tampered = dict(envelope, payload=codec.encode(forged).decode())  # signatures kept
    decision = follow(Trust(K0.public), chain(json.dumps(tampered)), FLEET)
    assert decision.status is TrustStatus.REJECTED
    assert "does not verify" in decision.reason


def only_signed_by(*keys: SigningKey, old: SigningKey = K0, new: SigningKey = K1) -> str:
    """A link K0 -> K1 at sequence 1 carrying the signatures of ``keys`` only."""
    rotation = KeyRotation(FLEET, 1, old.public.to_text(), new.public.to_text(), 1.0)
    bare = json.dumps(
        {"schema": 1, "kind": "cosigned", "payload": codec.encode(rotation).decode(), "sigs": {}}
    )
    for key in keys:
        bare = add_signature(bare, key)
    return bare


def test_a_co_signed_link_is_accepted_and_carries_both_signatures() -> None:
    parsed = parse_link(L1)
    assert set(parsed.signatures) == {K0.public.key_id, K1.public.key_id}
    assert parsed.signed_by(K0.public) and parsed.signed_by(K1.public)
    decision = follow(Trust(K0.public), chain(only_signed_by(K0, K1)), FLEET)
    assert decision.status is TrustStatus.ADOPTED and decision.trust == Trust(K1.public, 1)


@pytest.mark.parametrize(
    ("signers", "missing"),
    [
        ((K0,), "the new key"),  # the old key alone: the format before issue 24
        ((K1,), "the old key"),  # the new key alone: anyone can make one
        ((K0, FORGER), "the new key"),  # a third key is no substitute
        ((), "the old key"),
    ],
)
def test_a_link_without_both_signatures_is_refused(
    signers: tuple[SigningKey, ...], missing: str
) -> None:
    decision = follow(Trust(K0.public), chain(only_signed_by(*signers)), FLEET)
    assert decision.status is TrustStatus.REJECTED
    assert decision.trust == Trust(K0.public)
    assert missing in decision.reason and "does not verify" in decision.reason


ROOT, THIEF_ROOT = SigningKey.generate(), SigningKey.generate()


def test_with_a_pinned_root_a_stolen_signing_key_moves_nothing() -> None:
    # The thief holds K0 (the manager's key), makes its own key and co-signs: enough
    # for a station without a root, refused by a station that pins the fleet's root.
    thief = SigningKey.generate()
    stolen = chain(link(K0, thief, 1))
    assert follow(Trust(K0.public), stolen, FLEET).status is TrustStatus.ADOPTED
    pinned = follow(Trust(K0.public), stolen, FLEET, root=ROOT.public)
    assert pinned.status is TrustStatus.REJECTED and pinned.trust == Trust(K0.public)
    assert f"the root key {ROOT.public.key_id}" in pinned.reason
    # Its own root's signature is no better.
    own_root = follow(
        Trust(K0.public), chain(link(K0, thief, 1, root=THIEF_ROOT)), FLEET, root=ROOT.public
    )
    assert own_root.status is TrustStatus.REJECTED
    # The operator's rotation, signed by the root key offline, is followed.
    real = follow(Trust(K0.public), chain(link(K0, K1, 1, root=ROOT)), FLEET, root=ROOT.public)
    assert real.status is TrustStatus.ADOPTED and real.trust == Trust(K1.public, 1)
    # Prepared on the manager (old + new), signed on the operator's machine afterwards.
    offline = add_signature(link(K0, K1, 1), ROOT)
    two_step = follow(Trust(K0.public), chain(offline), FLEET, root=ROOT.public)
    assert two_step.status is TrustStatus.ADOPTED


def test_a_chain_is_signed_by_the_key_it_ends_at_and_refused_once_expired() -> None:
    now = 1_000_000.0
    fresh = TrustChain(FLEET, (L1,), expiry(now))
    decision = accept_chain(Trust(K0.public), sign_chain(K1, fresh), FLEET, root=None, now=now)
    assert decision.status is TrustStatus.ADOPTED
    assert decision.expires_at == now + LIFETIME_S
    # Signed by another key than the one it leads to (e.g. the retired one): refused.
    by_old = accept_chain(Trust(K0.public), sign_chain(K0, fresh), FLEET, root=None, now=now)
    assert by_old.status is TrustStatus.REJECTED and "not signed by the key" in by_old.reason
    # A replay after its expiry changes nothing.
    later = now + LIFETIME_S + 1
    replay = accept_chain(Trust(K0.public), sign_chain(K1, fresh), FLEET, root=None, now=later)
    assert replay.status is TrustStatus.REJECTED and replay.trust == Trust(K0.public)
    assert "expired" in replay.reason
    # Not an envelope at all (the plain chain of before): refused.
    plain = accept_chain(Trust(K0.public), codec.encode(fresh), FLEET, root=None, now=now)
    assert plain.status is TrustStatus.REJECTED


def test_expiry_refresh_and_staleness() -> None:
    now = 5_000_000.0
    with pytest.raises(ExpiredError, match="expired at"):
        check_not_expired("config v3", now - 1, now)
    check_not_expired("config v3", now + 1, now)
    check_not_expired("config v3", None, now)  # not stamped: judged by staleness alone
    assert needs_refresh(None, now)
    assert not needs_refresh(now + LIFETIME_S * 0.6, now)
    assert needs_refresh(now + LIFETIME_S * 0.4, now)
    day = 86400.0
    assert not staleness(None, None, now, 2 * day).stale  # never had one
    assert not staleness(now - day, now + 13 * day, now, 2 * day).stale
    late = staleness(now - 3 * day, now + 11 * day, now, 2 * day)
    assert late.stale and not late.expired and late.describe().startswith("stale since ")
    gone = staleness(now - day, now - 1, now, 2 * day)
    assert gone.stale and gone.expired and "expired at" in gone.describe()


def test_a_chain_has_bounds() -> None:
    with pytest.raises(ValidationError):
        TrustChain(FLEET, ())
    with pytest.raises(ValidationError):
        TrustChain(FLEET, ("x" * 5000,))
    with pytest.raises(ValidationError):
        KeyRotation(FLEET, 0, K0.public.to_text(), K1.public.to_text(), 1.0)


def test_a_key_ring_replaced_trusts_only_the_new_key_and_remembers_the_old() -> None:
    ring = KeyRing(K0.public)
    ring.replace(K1.public)
    assert set(ring) == {K1.public.key_id}
    assert ring.retired == {K0.public.key_id}
    ring.replace(K1.public)  # idempotent
    assert set(ring) == {K1.public.key_id} and ring.retired == {K0.public.key_id}

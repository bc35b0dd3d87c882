"""App signatures in Flower's format (issue 24): what a station's SuperNode verifies."""

from __future__ import annotations

import json

import pytest
import yaml  # type: ignore[import-untyped]
from flwr.supercore.fab import Fab
from flwr.supercore.primitives.asymmetric_ed25519 import create_message_to_sign
from flwr.supernode.start_client_internal import _verify_fab

from fedge.protocols.app_signing import (
    VALID_LICENSE,
    AppSignature,
    entity_id,
    fab_digest,
    message_to_sign,
    sign_fab,
    trusted_entities_yaml,
    verify_fab,
)
from fedge.protocols.errors import SignatureError
from fedge.protocols.signing import SigningKey

FAB = b"PK\x03\x04 a FAB's bytes"


def flower_fab(fab: bytes, *signatures: AppSignature) -> Fab:
    verifications = {VALID_LICENSE: "Valid", **dict(s.verification() for s in signatures)}
    return Fab(fab_digest(fab), fab, verifications)


def test_the_signed_message_is_flowers() -> None:
    digest = bytes(range(32))
    assert message_to_sign(digest, 1_700_000_000) == create_message_to_sign(digest, 1_700_000_000)


def test_flowers_own_check_accepts_the_fleet_keys_signature() -> None:
    key = SigningKey.generate()
    signature = sign_fab(FAB, key, now=1_700_000_000)
    entities = yaml.safe_load(trusted_entities_yaml(key.public))
    assert list(entities) == [entity_id(key.public)]
    assert _verify_fab(flower_fab(FAB, signature), entities)
    verify_fab(FAB, signature, key.public)  # ours agrees


def test_flowers_own_check_refuses_another_key_or_another_fab() -> None:
    fleet, thief = SigningKey.generate(), SigningKey.generate()
    entities = yaml.safe_load(trusted_entities_yaml(fleet.public))
    stolen = sign_fab(FAB, thief)
    assert not _verify_fab(flower_fab(FAB, stolen), entities)
    with pytest.raises(SignatureError, match="signed by"):
        verify_fab(FAB, stolen, fleet.public)
    # The fleet's signature moved onto other bytes does not verify either.
    genuine = sign_fab(FAB, fleet)
    other = FAB + b" and a payload"
    assert not _verify_fab(flower_fab(other, genuine), entities)
    with pytest.raises(SignatureError, match="another FAB"):
        verify_fab(other, genuine, fleet.public)
    # A signature under the fleet key's id but made by the thief: refused.
    forged = AppSignature(genuine.digest, genuine.key_id, stolen.signature, stolen.signed_at)
    assert not _verify_fab(flower_fab(FAB, forged), entities)
    with pytest.raises(SignatureError, match="does not verify"):
        verify_fab(FAB, forged, fleet.public)


def test_a_record_survives_its_encoding_and_bad_records_are_refused() -> None:
    signature = sign_fab(FAB, SigningKey.generate())
    assert AppSignature.decode(signature.encode()) == signature
    key_id, record = signature.verification()
    assert key_id == signature.key_id and json.loads(record)["signed_at"] == signature.signed_at
    for bad in (b"", b"{}", b"[1]", b'{"digest": "zz"}', b"x" * 5000):
        with pytest.raises(SignatureError):
            AppSignature.decode(bad)
    with pytest.raises(SignatureError, match="64 lowercase hex"):
        AppSignature("A" * 64, signature.key_id, signature.signature, 1)
    with pytest.raises(SignatureError, match="fpk_"):
        AppSignature(signature.digest, "key", signature.signature, 1)
    with pytest.raises(SignatureError, match="at least one key"):
        trusted_entities_yaml()

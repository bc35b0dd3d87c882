"""Ed25519 envelopes: round trip, tampering, key pinning, envelope strictness, key files."""

import base64
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.protocols import codec, signing
from fedge.protocols.config import EdgeConfig
from fedge.protocols.deployment import DeploymentDesired
from fedge.protocols.errors import (
    DecodeError,
    OversizedError,
    ProtocolError,
    SignatureError,
    ValidationError,
)
from fedge.protocols.signing import PublicKey, SigningKey

CONFIG = EdgeConfig(
    fleet="plant-a",
    edge="edge-01",
    version=3,
    default_threshold=0.5,
    class_thresholds={"dent": 0.75},
)
ENVELOPE_FIELDS = {"schema", "kind", "key_id", "payload", "sig"}


@pytest.fixture(scope="module")
def legit() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="module")
def attacker() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="module")
def keys(legit: SigningKey) -> dict[str, PublicKey]:
    return signing.trusted(legit.public)


def _fields(envelope: bytes) -> dict[str, Any]:
    obj = json.loads(envelope)
    assert isinstance(obj, dict)
    return obj


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _raises(
    error: type[ProtocolError], envelope: bytes, keys: signing.TrustedKeys
) -> ProtocolError:
    with pytest.raises(ProtocolError) as excinfo:
        signing.verify_envelope(envelope, keys)
    assert type(excinfo.value) is error, repr(excinfo.value)
    return excinfo.value


# ---------------------------------------------------------------- round trip and layout


def test_sign_then_open_round_trips(legit: SigningKey, keys: dict[str, PublicKey]) -> None:
    envelope = legit.sign(CONFIG)
    assert signing.open_signed(envelope, EdgeConfig, keys) == CONFIG
    assert signing.verify_envelope(envelope, keys) == codec.encode(CONFIG)


def test_envelope_layout(legit: SigningKey) -> None:
    envelope = legit.sign(CONFIG)
    obj = _fields(envelope)
    assert set(obj) == ENVELOPE_FIELDS
    assert obj["schema"] == codec.SCHEMA_VERSION == 1
    assert obj["kind"] == "signed"
    assert obj["key_id"] == legit.public.key_id
    assert obj["payload"] == codec.encode(CONFIG).decode()
    signature = base64.b64decode(obj["sig"], validate=True)
    assert len(signature) == 64
    # Compact and key-sorted, like the codec.
    assert envelope == _dump(obj)
    # The payload is carried verbatim as a string, not re-serialised as an object.
    assert isinstance(obj["payload"], str)


def test_signatures_are_deterministic(legit: SigningKey) -> None:
    assert legit.sign(CONFIG) == legit.sign(CONFIG)
    assert legit.sign(CONFIG) == legit.sign_payload(codec.encode(CONFIG))


def test_key_id_is_sha256_prefix_of_raw_public_key(legit: SigningKey) -> None:
    key_id = legit.public.key_id
    assert key_id == hashlib.sha256(legit.public.raw).hexdigest()[:16]
    assert len(key_id) == 16
    assert int(key_id, 16) >= 0
    assert signing.trusted(legit.public) == {key_id: legit.public}


def test_any_of_several_pinned_keys_verifies(legit: SigningKey, attacker: SigningKey) -> None:
    both = signing.trusted(legit.public, attacker.public)
    assert signing.open_signed(legit.sign(CONFIG), EdgeConfig, both) == CONFIG
    assert signing.open_signed(attacker.sign(CONFIG), EdgeConfig, both) == CONFIG


def test_sign_payload_signs_the_exact_bytes(legit: SigningKey, keys: dict[str, PublicKey]) -> None:
    payload = b'{"any": "bytes", "not": ["sorted"]}'
    assert signing.verify_envelope(legit.sign_payload(payload), keys) == payload


def test_nested_signed_manifest_survives_outer_envelope(
    legit: SigningKey, keys: dict[str, PublicKey]
) -> None:
    inner = legit.sign_payload(b'{"kind":"model_manifest"}').decode()
    desired = DeploymentDesired(
        fleet="plant-a", edge="edge-01", version=1, deployment_id="d1", manifest_envelope=inner
    )
    opened = signing.open_signed(legit.sign(desired), DeploymentDesired, keys)
    assert opened.manifest_envelope == inner
    assert signing.verify_envelope(inner.encode(), keys) == b'{"kind":"model_manifest"}'


# ---------------------------------------------------------------- tampering and pinning


def test_tampered_payload_is_rejected(legit: SigningKey, keys: dict[str, PublicKey]) -> None:
    obj = _fields(legit.sign(CONFIG))
    payload: str = obj["payload"]
    at = payload.index('"version":3') + len('"version":')
    obj["payload"] = payload[:at] + "4" + payload[at + 1 :]
    assert obj["payload"] != payload
    assert len(obj["payload"]) == len(payload)
    error = _raises(SignatureError, _dump(obj), keys)
    assert "does not match" in str(error)


@pytest.mark.parametrize("index", [0, 1, 50, -2])
def test_any_single_char_flip_in_payload_is_rejected(
    legit: SigningKey, keys: dict[str, PublicKey], index: int
) -> None:
    obj = _fields(legit.sign(CONFIG))
    payload: str = obj["payload"]
    i = index % len(payload)
    flipped = "A" if payload[i] != "A" else "B"
    obj["payload"] = payload[:i] + flipped + payload[i + 1 :]
    _raises(SignatureError, _dump(obj), keys)


def test_tampered_signature_is_rejected(legit: SigningKey, keys: dict[str, PublicKey]) -> None:
    obj = _fields(legit.sign(CONFIG))
    signature = bytearray(base64.b64decode(obj["sig"]))
    signature[0] ^= 0x01
    obj["sig"] = base64.b64encode(bytes(signature)).decode()
    _raises(SignatureError, _dump(obj), keys)


def test_unpinned_key_is_rejected(attacker: SigningKey, keys: dict[str, PublicKey]) -> None:
    envelope = attacker.sign(CONFIG)
    error = _raises(SignatureError, envelope, keys)
    assert "not pinned" in str(error)
    assert attacker.public.key_id in str(error)


def test_no_pinned_keys_rejects_everything(legit: SigningKey) -> None:
    error = _raises(SignatureError, legit.sign(CONFIG), {})
    assert "not pinned" in str(error)


def test_attacker_claiming_the_legit_key_id_is_rejected(
    legit: SigningKey, attacker: SigningKey, keys: dict[str, PublicKey]
) -> None:
    # key_id only selects a pinned key; the signature is checked against that pinned key.
    obj = _fields(attacker.sign(CONFIG))
    obj["key_id"] = legit.public.key_id
    error = _raises(SignatureError, _dump(obj), keys)
    assert "does not match" in str(error)


def test_attacker_key_pinned_under_a_legit_id_only_trusts_the_pinned_material(
    legit: SigningKey, attacker: SigningKey
) -> None:
    # A trust map that (wrongly or maliciously) has the attacker's key under the legit id
    # verifies with the pinned material, so the legit manager's envelope fails ...
    misplaced = {legit.public.key_id: attacker.public}
    _raises(SignatureError, legit.sign(CONFIG), misplaced)
    # ... and pinning is by key material: the legit map never accepts the attacker.
    obj = _fields(attacker.sign(CONFIG))
    obj["key_id"] = legit.public.key_id
    _raises(SignatureError, _dump(obj), signing.trusted(legit.public))


def test_replaying_a_signature_over_another_payload_is_rejected(
    legit: SigningKey, keys: dict[str, PublicKey]
) -> None:
    first = _fields(legit.sign(CONFIG))
    other = _fields(legit.sign(EdgeConfig(fleet="plant-a", edge="edge-02", version=3)))
    first["sig"] = other["sig"]
    _raises(SignatureError, _dump(first), keys)


# ---------------------------------------------------------------- envelope strictness


@pytest.mark.parametrize(
    "envelope",
    [
        pytest.param(codec.encode(CONFIG), id="bare_message"),
        pytest.param(b"[]", id="array"),
        pytest.param(b'"signed"', id="string"),
        pytest.param(b"null", id="null"),
        pytest.param(b"{}", id="empty_object"),
        pytest.param(b'{"kind":"Signed"}', id="kind_case"),
        pytest.param(b'{"schema":1,"kind":"edge_config","payload":"x"}', id="other_kind"),
    ],
)
def test_non_envelope_json_is_a_signature_error(
    envelope: bytes, keys: dict[str, PublicKey]
) -> None:
    error = _raises(SignatureError, envelope, keys)
    assert "signed" in str(error)


def test_not_json_is_a_decode_error(keys: dict[str, PublicKey]) -> None:
    _raises(DecodeError, b"{not json", keys)
    _raises(DecodeError, b'{"kind":"signed","sig":NaN}', keys)


def test_envelope_with_extra_field_is_a_decode_error(
    legit: SigningKey, keys: dict[str, PublicKey]
) -> None:
    obj = _fields(legit.sign(CONFIG))
    obj["alg"] = "none"
    error = _raises(DecodeError, _dump(obj), keys)
    assert "alg" in str(error)


@pytest.mark.parametrize("missing", ["key_id", "payload", "sig"])
def test_envelope_with_missing_field_is_a_decode_error(
    legit: SigningKey, keys: dict[str, PublicKey], missing: str
) -> None:
    obj = _fields(legit.sign(CONFIG))
    del obj[missing]
    _raises(DecodeError, _dump(obj), keys)


@pytest.mark.parametrize("schema", [2, 0, "1", None])
def test_envelope_with_wrong_schema_is_a_decode_error(
    legit: SigningKey, keys: dict[str, PublicKey], schema: Any
) -> None:
    obj = _fields(legit.sign(CONFIG))
    obj["schema"] = schema
    error = _raises(DecodeError, _dump(obj), keys)
    assert "schema" in str(error)


@pytest.mark.parametrize("field", ["key_id", "payload", "sig"])
@pytest.mark.parametrize("value", [1, None, ["x"], {"a": 1}, True])
def test_envelope_fields_must_be_strings(
    legit: SigningKey, keys: dict[str, PublicKey], field: str, value: Any
) -> None:
    obj = _fields(legit.sign(CONFIG))
    obj[field] = value
    error = _raises(DecodeError, _dump(obj), keys)
    assert "strings" in str(error)


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param("!!!not-base64!!!", id="punctuation"),
        pytest.param("AAA", id="bad_padding"),
        pytest.param("AA AA", id="space"),
        pytest.param("-_-_", id="urlsafe_alphabet"),
    ],
)
def test_malformed_base64_signature(
    legit: SigningKey, keys: dict[str, PublicKey], sig: str
) -> None:
    obj = _fields(legit.sign(CONFIG))
    obj["sig"] = sig
    error = _raises(SignatureError, _dump(obj), keys)
    assert "base64" in str(error)


@pytest.mark.parametrize("length", [0, 1, 63, 65])
def test_signature_of_wrong_length(
    legit: SigningKey, keys: dict[str, PublicKey], length: int
) -> None:
    obj = _fields(legit.sign(CONFIG))
    obj["sig"] = base64.b64encode(b"\x00" * length).decode()
    _raises(SignatureError, _dump(obj), keys)


def test_oversized_envelope(legit: SigningKey, keys: dict[str, PublicKey]) -> None:
    big = legit.sign_payload(b"x" * signing.MAX_ENVELOPE_BYTES)
    _raises(OversizedError, big, keys)


def test_open_signed_still_decodes_strictly(legit: SigningKey, keys: dict[str, PublicKey]) -> None:
    # A valid signature does not make the content valid.
    with pytest.raises(DecodeError, match="kind"):
        signing.open_signed(legit.sign(CONFIG), DeploymentDesired, keys)
    bad = json.loads(codec.encode(CONFIG))
    bad["default_threshold"] = 1.5
    with pytest.raises(ValidationError, match="default_threshold"):
        signing.open_signed(legit.sign_payload(_dump(bad)), EdgeConfig, keys)
    bad = json.loads(codec.encode(CONFIG))
    bad["extra"] = 1
    with pytest.raises(DecodeError, match="extra"):
        signing.open_signed(legit.sign_payload(_dump(bad)), EdgeConfig, keys)


def test_open_signed_checks_the_signature_before_decoding(
    attacker: SigningKey, keys: dict[str, PublicKey]
) -> None:
    with pytest.raises(SignatureError):
        signing.open_signed(attacker.sign_payload(b"not json at all"), EdgeConfig, keys)


# ---------------------------------------------------------------- keys on disk


def test_save_and_load_round_trip(tmp_path: Path, legit: SigningKey) -> None:
    private_path = tmp_path / "nested" / "manager.key"
    public_path = legit.save(private_path)
    assert public_path == tmp_path / "nested" / "manager.pub"
    assert public_path.read_text() == legit.public.to_text() + "\n"
    assert PublicKey.load(public_path) == legit.public

    loaded = SigningKey.load(private_path)
    assert loaded.public == legit.public
    assert loaded.sign(CONFIG) == legit.sign(CONFIG)
    keys = signing.trusted(PublicKey.load(public_path))
    assert signing.open_signed(loaded.sign(CONFIG), EdgeConfig, keys) == CONFIG


def test_private_key_file_is_0600(tmp_path: Path, legit: SigningKey) -> None:
    private_path = tmp_path / "manager.key"
    legit.save(private_path)
    assert stat.S_IMODE(os.stat(private_path).st_mode) == 0o600
    assert private_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def test_bug_save_over_existing_file_keeps_loose_mode(tmp_path: Path, legit: SigningKey) -> None:
    private_path = tmp_path / "manager.key"
    private_path.write_text("placeholder")
    private_path.chmod(0o644)
    legit.save(private_path)
    assert stat.S_IMODE(os.stat(private_path).st_mode) == 0o600


def test_repr_never_shows_key_material(tmp_path: Path, legit: SigningKey) -> None:
    private_path = tmp_path / "manager.key"
    legit.save(private_path)
    pem = private_path.read_text()
    private = serialization.load_pem_private_key(pem.encode(), password=None)
    assert isinstance(private, Ed25519PrivateKey)
    raw = private.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    pem_body = "".join(line for line in pem.splitlines() if not line.startswith("-----"))
    for text in (repr(legit), str(legit), f"{legit}", repr([legit])):
        assert legit.public.key_id in text
        assert "PRIVATE" not in text
        assert pem_body not in text
        for line in pem.splitlines()[1:-1]:
            assert line not in text
        assert raw.hex() not in text
        assert base64.b64encode(raw).decode() not in text
        assert repr(raw) not in text


def test_load_refuses_non_pem(tmp_path: Path) -> None:
    path = tmp_path / "garbage.key"
    path.write_bytes(b"not a key")
    with pytest.raises(SignatureError, match="not a PEM private key"):
        SigningKey.load(path)


def test_load_refuses_non_ed25519(tmp_path: Path) -> None:
    other = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "ec.key"
    path.write_bytes(
        other.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(SignatureError, match="not an Ed25519 key"):
        SigningKey.load(path)


def test_public_key_text_round_trip(legit: SigningKey) -> None:
    text = legit.public.to_text()
    assert len(base64.b64decode(text)) == 32
    assert PublicKey.from_text(text) == legit.public
    assert PublicKey.from_text(f"  {text}\n") == legit.public


@pytest.mark.parametrize("length", [0, 1, 31, 33, 64])
def test_public_key_from_text_wrong_length(length: int) -> None:
    text = base64.b64encode(b"\x01" * length).decode()
    with pytest.raises(SignatureError, match="32 bytes") as excinfo:
        PublicKey.from_text(text)
    assert str(length) in str(excinfo.value)


@pytest.mark.parametrize("text", ["not base64!", "AAA", "A" * 43, "-_" * 22, "AAAA AAAA"])
def test_public_key_from_text_not_base64(text: str) -> None:
    with pytest.raises(SignatureError, match="base64"):
        PublicKey.from_text(text)


# ---------------------------------------------------- regressions: bugs found in review, now fixed


def test_bug_public_key_from_non_ascii_text() -> None:
    with pytest.raises(SignatureError):
        PublicKey.from_text("é" * 44)


def test_bug_non_ascii_signature_escapes_as_value_error(
    legit: SigningKey, keys: dict[str, PublicKey]
) -> None:
    obj = _fields(legit.sign(CONFIG))
    obj["sig"] = "é"
    with pytest.raises(SignatureError):
        signing.verify_envelope(_dump(obj), keys)


def test_bug_lone_surrogate_payload_escapes_as_unicode_error(
    legit: SigningKey, keys: dict[str, PublicKey]
) -> None:
    obj = _fields(legit.sign(CONFIG))
    obj["payload"] = "\ud800"
    with pytest.raises(ProtocolError):
        signing.verify_envelope(_dump(obj), keys)


def test_bug_envelope_schema_true_is_accepted(
    legit: SigningKey, keys: dict[str, PublicKey]
) -> None:
    obj = _fields(legit.sign(CONFIG))
    obj["schema"] = True
    with pytest.raises(DecodeError, match="schema"):
        signing.verify_envelope(_dump(obj), keys)

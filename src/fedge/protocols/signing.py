"""Ed25519 signatures on everything the cloud sends down (configs, deployments, manifests).

A signed message travels as an envelope whose ``payload`` is the inner message's exact
JSON text, so verification never depends on re-serialising JSON the same way twice::

    {"schema": 1, "kind": "signed", "key_id": "<16 hex>", "payload": "<json>", "sig": "<b64>"}

Agents pin the manager's public key (``key_id`` only picks among pinned keys; it is never
trusted by itself). Private keys are written 0600 and never printed.
"""

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedge.protocols import codec
from fedge.protocols.errors import DecodeError, SignatureError

T = TypeVar("T")
MAX_ENVELOPE_BYTES = 128 * 1024


@dataclass(frozen=True)
class PublicKey:
    raw: bytes

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()[:16]

    def to_text(self) -> str:
        return base64.b64encode(self.raw).decode()

    @classmethod
    def from_text(cls, text: str) -> "PublicKey":
        try:
            raw = base64.b64decode(text.strip(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise SignatureError(f"public key is not base64: {exc}") from None
        if len(raw) != 32:
            raise SignatureError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
        return cls(raw)

    @classmethod
    def load(cls, path: Path) -> "PublicKey":
        return cls.from_text(path.read_text())


class SigningKey:
    """An Ed25519 private key. Its repr never shows key material."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = PublicKey(
            private.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        )

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.public.key_id})"

    @classmethod
    def generate(cls) -> "SigningKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> "SigningKey":
        try:
            private = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise SignatureError(f"{path} is not a PEM private key: {exc}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise SignatureError(f"{path} is not an Ed25519 key")
        return cls(private)

    def save(self, private_path: Path) -> Path:
        """Write the private key (0600) and ``<name>.pub`` beside it; return the .pub path."""
        pem = self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        if private_path.suffix == ".pub":
            raise SignatureError(f"{private_path}: a private key must not be named *.pub")
        private_path.parent.mkdir(parents=True, exist_ok=True)
        # O_CREAT's mode only applies to a new file: remove an old one so 0600 always holds.
        private_path.unlink(missing_ok=True)
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
        public_path = private_path.with_suffix(".pub")
        public_path.write_text(self.public.to_text() + "\n")
        return public_path

    def resign(self, envelope: bytes) -> bytes:
        """``envelope``'s payload, byte for byte, signed by this key instead: for a manager
        re-signing its own documents after a key rotation (the signature is not checked)."""
        return self.sign_payload(_fields(envelope)[1].encode())

    def sign_bytes(self, payload: bytes) -> bytes:
        return self._private.sign(payload)

    def sign(self, message: Any) -> bytes:
        """Encode ``message`` and wrap it in a signed envelope."""
        payload = codec.encode(message)
        return self.sign_payload(payload)

    def sign_payload(self, payload: bytes) -> bytes:
        envelope = {
            "schema": codec.SCHEMA_VERSION,
            "kind": "signed",
            "key_id": self.public.key_id,
            "payload": payload.decode(),
            "sig": base64.b64encode(self.sign_bytes(payload)).decode(),
        }
        return json.dumps(envelope, separators=(",", ":"), sort_keys=True).encode()


TrustedKeys = Mapping[str, PublicKey]


def trusted(*keys: PublicKey) -> dict[str, PublicKey]:
    return {key.key_id: key for key in keys}


class KeyRing(dict[str, PublicKey]):
    """The keys an agent trusts now, shared by all its handlers and changed in place when
    the manager's key rotates (rotation.py), with the ids of the keys it trusted before.

    A retired key verifies nothing that arrives; only what this agent verified and kept
    while that key was trusted (its kept models' manifests, restore.py) stays valid.
    """

    def __init__(self, *keys: PublicKey) -> None:
        super().__init__(trusted(*keys))
        self.retired: set[str] = set()

    def replace(self, key: PublicKey) -> None:
        """Trust ``key`` alone from now on; the keys trusted until now become retired."""
        old = [key_id for key_id in self if key_id != key.key_id]
        self[key.key_id] = key  # added before the old go: a reader never sees no key
        for key_id in old:
            del self[key_id]
        self.retired.update(old)


def _fields(envelope: bytes) -> tuple[str, str, str]:
    """The key id, payload and signature an envelope holds (nothing verified)."""
    obj = codec.loads(envelope, max_bytes=MAX_ENVELOPE_BYTES)
    if type(obj) is not dict or obj.get("kind") != "signed":
        raise SignatureError("not a signed envelope (kind 'signed' expected)")
    if type(obj.get("schema")) is not int or obj.get("schema") != codec.SCHEMA_VERSION:
        raise DecodeError(f"unsupported envelope schema {obj.get('schema')!r}")
    if set(obj) != {"schema", "kind", "key_id", "payload", "sig"}:
        raise DecodeError(f"envelope fields {sorted(obj)} are not the expected five")
    key_id, payload, sig = obj["key_id"], obj["payload"], obj["sig"]
    if not (type(key_id) is str and type(payload) is str and type(sig) is str):
        raise DecodeError("envelope key_id, payload and sig must be strings")
    return key_id, payload, sig


def signer_of(envelope: bytes) -> str:
    """The key id an envelope *claims*; only to choose a key or spot a stale signature,
    never as a reason to trust it."""
    return _fields(envelope)[0]


def unverified_payload(envelope: bytes, cls: type[T]) -> T:
    """The inner message of an envelope whose signature was checked elsewhere: by the
    caller, or by this agent before the key that signed it was retired (rotation.py)."""
    return codec.decode(_fields(envelope)[1].encode(), cls, max_bytes=MAX_ENVELOPE_BYTES)


def verify_envelope(envelope: bytes, keys: TrustedKeys) -> bytes:
    """Return the signed payload bytes, or raise SignatureError / DecodeError."""
    key_id, payload, sig = _fields(envelope)
    key = keys.get(key_id)
    if key is None:
        raise SignatureError(f"signed by key {key_id[:16]!r}, which is not pinned here")
    try:
        signature = base64.b64decode(sig, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("signature is not base64") from None
    try:
        payload_bytes = payload.encode()
    except UnicodeEncodeError:
        raise DecodeError("envelope payload is not valid UTF-8 text") from None
    try:
        Ed25519PublicKey.from_public_bytes(key.raw).verify(signature, payload_bytes)
    except InvalidSignature:
        raise SignatureError(f"signature does not match the payload (key {key_id})") from None
    return payload_bytes


def signature_valid(key: PublicKey, payload: bytes, signature_b64: str) -> bool:
    """Whether ``signature_b64`` is ``key``'s Ed25519 signature of ``payload`` (for
    documents with several signatures, rotation.py)."""
    try:
        signature = base64.b64decode(signature_b64, validate=True)
        Ed25519PublicKey.from_public_bytes(key.raw).verify(signature, payload)
    except (binascii.Error, ValueError, InvalidSignature):
        return False
    return True


def open_signed(envelope: bytes, cls: type[T], keys: TrustedKeys) -> T:
    """Verify, then strictly decode the inner message as ``cls``."""
    return codec.decode(verify_envelope(envelope, keys), cls, max_bytes=MAX_ENVELOPE_BYTES)

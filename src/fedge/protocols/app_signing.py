"""Signatures on the Flower apps (FABs) the fleet runs, in the form Flower's SuperNode checks.

A station's SuperNode runs a federated job's ClientApp from the app bundle (FAB) the
SuperLink hands it: whatever code that bundle names runs in the station's process, next to
its images. So a station runs only bundles the fleet signed (issue 24): ``fedge aggregator
run`` signs the exact FAB bytes it submits with the manager's Ed25519 signing key (the key
every station already pins and follows through rotations), the SuperLink's front attaches
that signature to the FAB when a station fetches it, and the station's SuperNode, started
with ``--trusted-entities`` naming the key it trusts, verifies it with Flower's own code
before storing the FAB or starting any of it; a FAB without a valid signature of a trusted
key gets an error reply and nothing of it runs.

The signed message is Flower's (``flwr.supercore.primitives.asymmetric_ed25519``
``create_message_to_sign``): the signing time as 8 big-endian bytes followed by the FAB's
SHA-256 digest; the signature travels base64url-encoded with its time in the FAB's
``verifications`` under the key's id, with ``valid_license`` set (without it Flower's
SuperNode refuses before it checks any signature). Written here without Flower: the agent
writes the trusted-entities file on its inference path, which never imports ``flwr``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fedge.protocols.errors import SignatureError
from fedge.protocols.signing import PublicKey, SigningKey

KEY_ID_PREFIX = "fpk_"  # Flower's public-key ids ("Flower Public Key")
VALID_LICENSE = "valid_license"  # the verifications entry Flower's SuperNode requires
MAX_RECORD_BYTES = 4096


def entity_id(key: PublicKey) -> str:
    """The id a station's trusted-entities file and a FAB's verifications use for ``key``."""
    return KEY_ID_PREFIX + key.key_id


def message_to_sign(fab_digest: bytes, signed_at: int) -> bytes:
    """Flower's canonical message: ``signed_at`` (8 bytes, big-endian) + the FAB's digest."""
    if len(fab_digest) != 32:
        raise SignatureError(f"a FAB digest is 32 bytes (SHA-256), got {len(fab_digest)}")
    if not 0 <= signed_at < 2**63:
        raise SignatureError(f"a signing time must be seconds since 1970, got {signed_at}")
    return signed_at.to_bytes(8, byteorder="big") + fab_digest


def fab_digest(fab: bytes) -> str:
    """The FAB's SHA-256 as hex: Flower's ``fab_hash``, what the SuperLink stores it under."""
    return hashlib.sha256(fab).hexdigest()


@dataclass(frozen=True)
class AppSignature:
    """One key's signature on one FAB (by its digest)."""

    digest: str  # hex SHA-256 of the FAB
    key_id: str  # entity_id of the signing key
    signature: bytes
    signed_at: int

    def __post_init__(self) -> None:
        if len(self.digest) != 64 or any(c not in "0123456789abcdef" for c in self.digest):
            raise SignatureError(f"a FAB digest is 64 lowercase hex digits, got {self.digest!r}")
        if not self.key_id.startswith(KEY_ID_PREFIX):
            raise SignatureError(f"a signer's id starts with {KEY_ID_PREFIX}, got {self.key_id!r}")
        if len(self.signature) != 64:
            raise SignatureError(f"an Ed25519 signature is 64 bytes, got {len(self.signature)}")

    def verification(self) -> tuple[str, str]:
        """This signature as one entry of a FAB's ``verifications`` (Flower's JSON form)."""
        encoded = base64.urlsafe_b64encode(self.signature).decode().rstrip("=")
        return self.key_id, json.dumps({"signature": encoded, "signed_at": self.signed_at})

    def encode(self) -> bytes:
        """As stored beside the SuperLink (one JSON file per signed FAB)."""
        return json.dumps(
            {
                "digest": self.digest,
                "key_id": self.key_id,
                "signature": base64.b64encode(self.signature).decode(),
                "signed_at": self.signed_at,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> AppSignature:
        if len(raw) > MAX_RECORD_BYTES:
            raise SignatureError(f"an app signature record is at most {MAX_RECORD_BYTES} bytes")
        try:
            data = json.loads(raw)
            return cls(
                digest=str(data["digest"]),
                key_id=str(data["key_id"]),
                signature=base64.b64decode(str(data["signature"]), validate=True),
                signed_at=int(data["signed_at"]),
            )
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise SignatureError(f"not an app signature record: {exc}") from None


def sign_fab(fab: bytes, key: SigningKey, *, now: float | None = None) -> AppSignature:
    """``key``'s signature on ``fab``, as Flower's SuperNode verifies it."""
    signed_at = int(time.time() if now is None else now)
    digest = hashlib.sha256(fab).digest()
    signature = key.sign_bytes(message_to_sign(digest, signed_at))
    return AppSignature(digest.hex(), entity_id(key.public), signature, signed_at)


def verify_fab(fab: bytes, signature: AppSignature, key: PublicKey) -> None:
    """Raise :class:`SignatureError` unless ``signature`` is ``key``'s, on ``fab``.

    The same check the station's SuperNode makes (for tests and the front's own sanity
    check); the station never relies on the front having made it."""
    digest = hashlib.sha256(fab).digest()
    if digest.hex() != signature.digest:
        raise SignatureError("the signature is for another FAB (its digest differs)")
    if signature.key_id != entity_id(key):
        raise SignatureError(f"signed by {signature.key_id}, not by {entity_id(key)}")
    try:
        Ed25519PublicKey.from_public_bytes(key.raw).verify(
            signature.signature, message_to_sign(digest, signature.signed_at)
        )
    except InvalidSignature:
        raise SignatureError("the FAB's signature does not verify") from None


def openssh_public_key(key: PublicKey) -> str:
    """``key`` as the OpenSSH line (``ssh-ed25519 AAAA...``) Flower's trusted entities take."""
    public = Ed25519PublicKey.from_public_bytes(key.raw)
    return public.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()


def trusted_entities_yaml(*keys: PublicKey) -> str:
    """The ``--trusted-entities`` file for a SuperNode that runs only apps ``keys`` signed.

    YAML, one ``id: 'ssh-ed25519 ...'`` line per key (the id and the key contain no
    character YAML would read specially inside single quotes)."""
    if not keys:
        raise SignatureError("a SuperNode's trusted entities need at least one key")
    return "".join(f"{entity_id(key)}: '{openssh_public_key(key)}'\n" for key in keys)

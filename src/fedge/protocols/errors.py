"""Errors for what arrives on the wire (see the tree in :mod:`fedge.errors`)."""

from fedge.errors import FedgeError


class ProtocolError(FedgeError):
    """A message or artifact is not acceptable; ``reason`` is a short machine-readable tag."""

    reason = "protocol"


class DecodeError(ProtocolError):
    """Malformed JSON, wrong type, unknown or missing field, unsupported schema."""

    reason = "malformed"


class OversizedError(DecodeError):
    """The payload is over the size limit; it was not parsed."""

    reason = "oversized"


class ValidationError(ProtocolError):
    """Well-formed, but a value breaks a rule (range, format, consistency)."""

    reason = "invalid"


class SignatureError(ProtocolError):
    """Signature missing, forged, tampered, or made by a key that is not pinned."""

    reason = "bad_signature"


class ExpiredError(ProtocolError):
    """A signed document whose ``expires_at`` has passed: a replay of an old one, or a
    manager that stopped refreshing what it sent (a freeze attack, issue 24)."""

    reason = "expired"

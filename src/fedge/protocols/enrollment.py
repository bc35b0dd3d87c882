"""What a device and the manager's enrollment endpoint exchange (issue 13).

The device makes its key, sends a CSR with the one-time token it was given, and receives
its certificate, the fleet CA and what its agent.toml needs. The key never travels. The
token a person copies to the device carries the CA's fingerprint after a dot
(``<secret>.<sha256 hex>``, the way kubeadm's join pins the cluster CA): the device
trusts the enrollment server only if it presents a chain to exactly that CA.
"""

import re
from dataclasses import dataclass, field

from fedge.protocols import validate
from fedge.protocols.errors import ValidationError

MAX_CSR_CHARS = 8 * 1024
_SECRET = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
_PIN = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class JoinToken:
    secret: str  # what the manager stores the hash of
    ca_sha256: str  # hex fingerprint of the fleet CA certificate (DER)

    def __post_init__(self) -> None:
        if not _SECRET.match(self.secret) or not _PIN.match(self.ca_sha256):
            raise ValidationError("not an enrollment token (expected <secret>.<64 hex>)")

    def __str__(self) -> str:
        return f"{self.secret}.{self.ca_sha256}"

    def __repr__(self) -> str:  # never print the secret
        return f"JoinToken(ca_sha256={self.ca_sha256[:16]}...)"

    @classmethod
    def parse(cls, text: str) -> "JoinToken":
        secret, _, pin = text.strip().partition(".")
        return cls(secret, pin.lower())


@dataclass(frozen=True)
class EnrollRequest:
    edge: str
    token: str
    csr: str  # PEM

    def __post_init__(self) -> None:
        validate.identifier(self.edge, "edge")
        if not _SECRET.match(self.token):
            raise ValidationError("token is not an enrollment token secret")
        if len(self.csr) > MAX_CSR_CHARS:
            raise ValidationError(f"CSR over {MAX_CSR_CHARS} characters")

    def __repr__(self) -> str:
        return f"EnrollRequest(edge={self.edge!r})"


@dataclass(frozen=True)
class EnrollResponse:
    fleet: str
    edge: str
    certificate: str  # PEM, the station's
    ca: str  # PEM, the fleet CA
    manager_public_key: str  # the pinned Ed25519 key signed documents are checked with
    broker_host: str
    broker_port: int
    grpc_target: str
    superlink: str
    # The fleet's offline root key, when it has one: the station pins it and follows a
    # key rotation only with its signature (issue 24).
    manager_root_key: str | None = field(default=None, metadata=validate.OMIT_WHEN_NONE)

    def __post_init__(self) -> None:
        validate.identifier(self.fleet, "fleet")
        validate.identifier(self.edge, "edge")
        if self.manager_root_key is not None:
            validate.bounded_text(self.manager_root_key, "manager_root_key", 64)
        if not 0 < self.broker_port < 65536:
            raise ValidationError(f"broker_port {self.broker_port} out of range")


@dataclass(frozen=True)
class RenewRequest:
    """A station renewing its certificate: a CSR for a new key, sent over TLS with its
    current certificate (which is what authenticates it; no token)."""

    csr: str  # PEM

    def __post_init__(self) -> None:
        if len(self.csr) > MAX_CSR_CHARS:
            raise ValidationError(f"CSR over {MAX_CSR_CHARS} characters")

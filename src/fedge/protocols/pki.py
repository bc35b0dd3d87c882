"""The fleet's X.509 PKI: one CA per fleet, certificates that name who holds them.

Every TLS connection in a fleet (Mosquitto, fedge's gRPC services, the Flower SuperLink)
is authenticated by certificates from the fleet's own CA, the way AWS IoT Core, NVIDIA
FLARE's provisioned startup kits and Mosquitto's ``use_identity_as_username`` do it:

- the certificate's common name (CN) is the holder's identity -- an edge id, an operator
  name, the manager's broker user, or a server's name -- and the broker takes it as the
  username its per-edge ACL is written for;
- its organizational unit (OU) is the holder's role (:class:`Role`), so an operator's
  certificate can never pass for the manager's, nor an edge's for a server's;
- keys are ECDSA P-256: every TLS stack here (OpenSSL in Mosquitto, BoringSSL in gRPC)
  speaks it, and its handshakes are cheap enough for a thousand stations reconnecting.

A station's key is made on the station (:func:`new_key_and_csr`); the CA only ever sees
its certificate signing request (:meth:`FleetCA.sign_csr`), which is refused unless it
names the identity an enrollment token was issued for. Revocation is a CRL the broker
reloads and the gRPC services consult by serial.

Pure except :meth:`FleetCA.save` / :meth:`FleetCA.load` and :func:`write_private`, which
write keys 0600.
"""

import datetime as dt
import enum
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedge.protocols import validate
from fedge.protocols.errors import ProtocolError

MAX_PEM_BYTES = 16 * 1024
CA_DAYS = 3650
SERVER_DAYS = 825
CLIENT_DAYS = 90  # stations renew well before (see doctor / renewal)
CRL_DAYS = 365  # the manager issues it again when a third is left (credential_renewal.py)


class CertificateError(ProtocolError):
    """A certificate, CSR or CRL is malformed, not from this fleet's CA, or not allowed."""

    reason = "bad_certificate"


class Role(enum.StrEnum):
    """What a certificate's holder is (its OU); decides what it may connect as."""

    EDGE = "edge"
    MANAGER = "manager"
    OPERATOR = "operator"
    SERVER = "server"


@dataclass(frozen=True)
class CertInfo:
    """What a certificate says about its holder (read from a certificate, never trusted
    before the TLS stack or :meth:`FleetCA.verify` has checked it)."""

    identity: str
    role: Role | None
    serial: int
    not_before: dt.datetime
    not_after: dt.datetime
    fingerprint: str  # "sha256:<hex>" of the DER certificate

    def expires_in_days(self, now: dt.datetime) -> float:
        return (self.not_after - now).total_seconds() / 86400.0


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey, passphrase: bytes | None = None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase)
        if passphrase
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


def load_key(pem: bytes, passphrase: bytes | None = None) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=passphrase or None)
    except TypeError:
        raise CertificateError(
            "the key is encrypted: give its passphrase (FEDGE_CA_PASSPHRASE)"
        ) from None
    except ValueError as exc:
        raise CertificateError(f"not a PEM private key, or a wrong passphrase: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError("fleet keys are ECDSA P-256")
    return key


def write_private(path: Path, data: bytes) -> None:
    """Write a private key 0600 (an old file is removed first: O_CREAT's mode applies
    only to a new file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def check_pem(pem: bytes, what: str) -> None:
    if len(pem) > MAX_PEM_BYTES:
        raise CertificateError(f"{what} is {len(pem)} bytes, over the {MAX_PEM_BYTES} limit")


def load_certificate(pem: bytes) -> x509.Certificate:
    check_pem(pem, "certificate")
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise CertificateError(f"not a PEM certificate: {exc}") from None


def fingerprint(cert: x509.Certificate) -> str:
    return "sha256:" + hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def name_attr(name: x509.Name, oid: x509.ObjectIdentifier) -> str | None:
    values = name.get_attributes_for_oid(oid)
    if len(values) != 1:
        return None
    value = values[0].value
    return value if isinstance(value, str) else value.decode()


def cert_info(cert: x509.Certificate) -> CertInfo:
    identity = name_attr(cert.subject, NameOID.COMMON_NAME)
    if identity is None:
        raise CertificateError("the certificate names no single common name")
    role_text = name_attr(cert.subject, NameOID.ORGANIZATIONAL_UNIT_NAME)
    role = Role(role_text) if role_text in set(Role) else None
    return CertInfo(
        identity=identity,
        role=role,
        serial=cert.serial_number,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        fingerprint=fingerprint(cert),
    )


def new_key_and_csr(identity: str) -> tuple[bytes, bytes]:
    """A fresh P-256 key (PEM, unencrypted: write it 0600) and a CSR naming ``identity``;
    made where the key will live, so the key never travels."""
    validate.identifier(identity, "identity")
    key = new_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
        .sign(key, hashes.SHA256())
    )
    return key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class TlsFiles:
    """Where one TLS endpoint's credentials are: what every adapter (paho, gRPC,
    Mosquitto's config, Flower's flags) is given. Paths, so keys are read by the library
    that uses them and never pass through our logs."""

    ca: Path  # the fleet CA certificate the peer must chain to
    cert: Path  # this endpoint's certificate
    key: Path  # its private key (0600)
    crl: Path | None = None  # servers: the fleet's revoked certificates

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) PEM bytes, for libraries that take bytes (gRPC)."""
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()


def revoked_serials(crl_pem: bytes) -> frozenset[int]:
    """The serials a CRL lists (the caller has checked it came from the fleet's CA, e.g. by
    reading it from the manager's home)."""
    try:
        crl = x509.load_pem_x509_crl(crl_pem)
    except ValueError as exc:
        raise CertificateError(f"not a PEM CRL: {exc}") from None
    return frozenset(entry.serial_number for entry in crl)

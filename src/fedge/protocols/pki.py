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
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedge.protocols import validate
from fedge.protocols.errors import ProtocolError

MAX_PEM_BYTES = 16 * 1024
CA_DAYS = 3650
SERVER_DAYS = 825
CLIENT_DAYS = 90  # stations renew well before (see doctor / renewal)


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


def _new_key() -> ec.EllipticCurvePrivateKey:
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


def _check_pem(pem: bytes, what: str) -> None:
    if len(pem) > MAX_PEM_BYTES:
        raise CertificateError(f"{what} is {len(pem)} bytes, over the {MAX_PEM_BYTES} limit")


def load_certificate(pem: bytes) -> x509.Certificate:
    _check_pem(pem, "certificate")
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise CertificateError(f"not a PEM certificate: {exc}") from None


def fingerprint(cert: x509.Certificate) -> str:
    return "sha256:" + hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _name_attr(name: x509.Name, oid: x509.ObjectIdentifier) -> str | None:
    values = name.get_attributes_for_oid(oid)
    if len(values) != 1:
        return None
    value = values[0].value
    return value if isinstance(value, str) else value.decode()


def cert_info(cert: x509.Certificate) -> CertInfo:
    identity = _name_attr(cert.subject, NameOID.COMMON_NAME)
    if identity is None:
        raise CertificateError("the certificate names no single common name")
    role_text = _name_attr(cert.subject, NameOID.ORGANIZATIONAL_UNIT_NAME)
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
    key = _new_key()
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


@dataclass(frozen=True)
class Revoked:
    serial: int
    at: dt.datetime


class FleetCA:
    """The fleet's certificate authority. Its repr never shows key material."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self._key = key

    def __repr__(self) -> str:
        return f"FleetCA({self.cert.subject.rfc4514_string()}, {fingerprint(self.cert)[:23]})"

    # -- creation and storage

    @classmethod
    def create(cls, fleet: str, *, now: dt.datetime | None = None) -> "FleetCA":
        validate.identifier(fleet, "fleet")
        now = now or utcnow()
        key = _new_key()
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"fedge fleet {fleet}"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"fedge {fleet} root CA"),
            ]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    def save(self, cert_path: Path, key_path: Path, passphrase: bytes | None = None) -> None:
        write_private(key_path, key_pem(self._key, passphrase))
        cert_path.write_bytes(self.cert_pem)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path, passphrase: bytes | None = None) -> "FleetCA":
        cert = load_certificate(cert_path.read_bytes())
        key = load_key(key_path.read_bytes(), passphrase)
        if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
            raise CertificateError(f"{key_path} is not the key of {cert_path}")
        return cls(cert, key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    # -- issuing

    def _issue(
        self,
        public_key: ec.EllipticCurvePublicKey,
        identity: str,
        role: Role,
        *,
        days: float,
        hosts: Sequence[str] = (),
        now: dt.datetime | None = None,
    ) -> bytes:
        now = now or utcnow()
        usage = (
            ExtendedKeyUsageOID.SERVER_AUTH
            if role is Role.SERVER
            else (ExtendedKeyUsageOID.CLIENT_AUTH)
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
                        x509.NameAttribute(NameOID.COMMON_NAME, identity),
                    ]
                )
            )
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        if hosts:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_san(host) for host in hosts]), critical=False
            )
        cert = builder.sign(self._key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM)

    def issue_server(
        self, name: str, hosts: Sequence[str], *, days: float = SERVER_DAYS
    ) -> tuple[bytes, bytes]:
        """A server certificate and key (PEM) for ``hosts`` (names or IP addresses)."""
        if not hosts:
            raise CertificateError("a server certificate needs at least one host name")
        key = _new_key()
        return self._issue(key.public_key(), name, Role.SERVER, days=days, hosts=hosts), key_pem(
            key
        )

    def issue_client(
        self,
        identity: str,
        role: Role,
        *,
        days: float = CLIENT_DAYS,
        now: dt.datetime | None = None,
    ) -> tuple[bytes, bytes]:
        """A client certificate and key for a holder whose key may be made here (the
        manager itself, an operator's tool on the manager's machine, tests)."""
        validate.identifier(identity, "identity")
        if role is Role.SERVER:
            raise CertificateError("use issue_server for servers")
        key = _new_key()
        return self._issue(key.public_key(), identity, role, days=days, now=now), key_pem(key)

    def sign_csr(
        self,
        csr_pem: bytes,
        *,
        identity: str,
        role: Role = Role.EDGE,
        days: float = CLIENT_DAYS,
        now: dt.datetime | None = None,
    ) -> bytes:
        """Sign a holder's CSR. Refused unless it is well formed, self-signed by its key,
        and names exactly ``identity`` (what the enrollment token was issued for)."""
        _check_pem(csr_pem, "CSR")
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise CertificateError(f"not a PEM certificate signing request: {exc}") from None
        if not csr.is_signature_valid:
            raise CertificateError("the CSR's signature does not match its key")
        named = _name_attr(csr.subject, NameOID.COMMON_NAME)
        if named != identity:
            raise CertificateError(f"the CSR names {named!r}, not {identity!r}")
        public = csr.public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name != "secp256r1":
            raise CertificateError("the CSR's key must be ECDSA P-256")
        if role is Role.SERVER:
            raise CertificateError("a CSR cannot ask for a server certificate")
        return self._issue(public, identity, role, days=days, now=now)

    def crl(self, revoked: Iterable[Revoked], *, now: dt.datetime | None = None) -> bytes:
        """A CRL (PEM) listing ``revoked``; valid for a year (fleet components reload it
        whenever it changes, not when it expires)."""
        now = now or utcnow()
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.cert.subject)
            .last_update(now - dt.timedelta(minutes=5))
            .next_update(now + dt.timedelta(days=365))
        )
        for entry in revoked:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(entry.serial)
                .revocation_date(entry.at)
                .build()
            )
        return builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    # -- checking (the TLS stacks check chains themselves; this is for files and tools)

    def verify(self, cert_pem: bytes, *, now: dt.datetime | None = None) -> CertInfo:
        """The certificate's holder, if this CA issued it and it is valid at ``now``."""
        cert = load_certificate(cert_pem)
        if cert.issuer != self.cert.subject:
            raise CertificateError("the certificate was not issued by this fleet's CA")
        try:
            cert.verify_directly_issued_by(self.cert)
        except (ValueError, TypeError, InvalidSignature):
            raise CertificateError("the certificate's signature is not this fleet CA's") from None
        info = cert_info(cert)
        now = now or utcnow()
        if not info.not_before <= now <= info.not_after:
            raise CertificateError(
                f"the certificate of {info.identity!r} is not valid now "
                f"({info.not_before:%Y-%m-%d} .. {info.not_after:%Y-%m-%d})"
            )
        return info


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)

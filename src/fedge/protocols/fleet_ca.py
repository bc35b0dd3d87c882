"""The fleet's certificate authority (issue 13): one ECDSA P-256 root per fleet, kept by
the manager, that issues server certificates (broker, gRPC, SuperLink, enrollment),
client certificates (edges, operators, the manager) and the CRL. Certificates, keys and
CSRs as such are :mod:`fedge.protocols.pki`'s.
"""

import datetime as dt
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedge.protocols import validate
from fedge.protocols.pki import (
    CA_DAYS,
    CLIENT_DAYS,
    CRL_DAYS,
    SERVER_DAYS,
    CertificateError,
    CertInfo,
    Role,
    cert_info,
    check_pem,
    fingerprint,
    key_pem,
    load_certificate,
    load_key,
    name_attr,
    new_key,
    utcnow,
    write_private,
)


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
        key = new_key()
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
        self,
        name: str,
        hosts: Sequence[str],
        *,
        days: float = SERVER_DAYS,
        now: dt.datetime | None = None,
    ) -> tuple[bytes, bytes]:
        """A server certificate and key (PEM) for ``hosts`` (names or IP addresses)."""
        if not hosts:
            raise CertificateError("a server certificate needs at least one host name")
        key = new_key()
        cert = self._issue(key.public_key(), name, Role.SERVER, days=days, hosts=hosts, now=now)
        return cert, key_pem(key)

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
        key = new_key()
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
        check_pem(csr_pem, "CSR")
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise CertificateError(f"not a PEM certificate signing request: {exc}") from None
        if not csr.is_signature_valid:
            raise CertificateError("the CSR's signature does not match its key")
        named = name_attr(csr.subject, NameOID.COMMON_NAME)
        if named != identity:
            raise CertificateError(f"the CSR names {named!r}, not {identity!r}")
        public = csr.public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name != "secp256r1":
            raise CertificateError("the CSR's key must be ECDSA P-256")
        if role is Role.SERVER:
            raise CertificateError("a CSR cannot ask for a server certificate")
        return self._issue(public, identity, role, days=days, now=now)

    def crl(
        self, revoked: Iterable[Revoked], *, now: dt.datetime | None = None, days: float = CRL_DAYS
    ) -> bytes:
        """A CRL (PEM) listing ``revoked``, valid ``days``. Past its next-update a TLS stack
        (Mosquitto's OpenSSL) refuses every client, so the manager issues it again well
        before (:mod:`fedge.edge_manager.security.renewal`), not only on revocation."""
        now = now or utcnow()
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.cert.subject)
            .last_update(now - dt.timedelta(minutes=5))
            .next_update(now + dt.timedelta(days=days))
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

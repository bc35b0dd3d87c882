"""gRPC credentials from a :class:`~fedge.protocols.pki.TlsFiles` (issue 13).

Servers require a client certificate from the fleet CA; clients present the station's
certificate and trust only the fleet CA. ``None`` means plain TCP, for ``--insecure``
development only. Keys are read here, from the files, and go straight into gRPC.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import grpc
from cryptography.hazmat.primitives import serialization

from fedge.protocols import pki
from fedge.protocols.pki import TlsFiles

ChannelOptions = Sequence[tuple[str, int | str]]


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Mutual TLS: a peer without a certificate chaining to ``tls.ca`` never gets a call
    through (BoringSSL also checks its validity period). The files are read again at the
    first handshake after they change (the manager renews its server certificate before
    it ends, credential_renewal.py), so a renewal needs no restart."""
    files = ServerFiles(tls)
    # The stub's fetcher type lacks the None ("no change") that gRPC's docs allow.
    return grpc.dynamic_ssl_server_credentials(
        files.initial,
        files,  # type: ignore[arg-type]
        require_client_authentication=True,
    )


def _signature(tls: TlsFiles) -> tuple[tuple[int, int, int], ...]:
    stats = (os.stat(tls.cert), os.stat(tls.key), os.stat(tls.ca))
    return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)


def _configuration(tls: TlsFiles) -> grpc.ServerCertificateConfiguration:
    """The server's certificate configuration; ValueError when the key is not the
    certificate's (a pair caught between its two writes)."""
    ca, cert, key = tls.read()
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        cert_public = pki.load_certificate(cert).public_key().public_bytes(*spki)
        key_public = pki.load_key(key).public_key().public_bytes(*spki)
    except pki.CertificateError as exc:
        raise ValueError(str(exc)) from None
    if cert_public != key_public:
        raise ValueError(f"{tls.key} is not the key of {tls.cert}")
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


class ServerFiles:
    """gRPC's certificate fetcher: called before every handshake, it answers a new
    configuration once the files changed (one ``stat`` each otherwise), or None to keep
    the current one -- also while the files are unreadable or do not match (a renewal
    half written): the next handshake looks again."""

    def __init__(self, tls: TlsFiles) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._signature = _signature(tls)
        self.initial = _configuration(tls)
        self.reloads = 0

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            signature = _signature(self.tls)
            with self._lock:
                if signature == self._signature:
                    return None
            configuration = _configuration(self.tls)
        except (OSError, ValueError):
            return None
        with self._lock:
            self._signature = signature
            self.reloads += 1
        return configuration


class ClientChannel:
    """One channel to ``target``; under TLS it is rebuilt when the station's certificate
    files change (a renewed certificate is used from the next call on, without a restart:
    gRPC cannot swap a channel's credentials in place).

    Raises ``OSError`` when the TLS files cannot be read.
    """

    def __init__(self, target: str, tls: TlsFiles | None, options: ChannelOptions = ()) -> None:
        self.target = target
        self.tls = tls
        self.options = list(options)
        self._signature: tuple[tuple[int, int, int], ...] = ()
        self._lock = threading.Lock()
        self._channel = self._open()

    def _open(self) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.target, options=self.options)
        self._signature = _signature(self.tls)
        ca, cert, key = self.tls.read()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        return grpc.secure_channel(self.target, credentials, options=self.options)

    def get(self) -> grpc.Channel:
        """The channel, reopened first if the certificate files changed on disk."""
        if self.tls is None:
            return self._channel
        with self._lock:
            if _signature(self.tls) != self._signature:
                old, self._channel = self._channel, self._open()
                old.close()
            return self._channel

    def close(self) -> None:
        self._channel.close()

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

from fedge.protocols.pki import TlsFiles

ChannelOptions = Sequence[tuple[str, int | str]]


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Mutual TLS: a peer without a certificate chaining to ``tls.ca`` never gets a call
    through (BoringSSL also checks its validity period)."""
    ca, cert, key = tls.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def _signature(tls: TlsFiles) -> tuple[tuple[int, int, int], ...]:
    stats = (os.stat(tls.cert), os.stat(tls.key), os.stat(tls.ca))
    return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)


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

"""Fetching one image from a station over the fleet's mutual TLS (issue 30, item 3).

The manager presents its own client certificate (role manager); the station's agent
answers with its certificate (role edge, common name its edge id). A station's
certificate is issued for client use only (protocols/fleet_ca.py), which OpenSSL would
refuse as a server's, so the chain is checked here, on the certificate the handshake
proved the peer holds: issued by the fleet CA, in its dates, an edge's, naming the
station asked for, not revoked. Nothing is sent before that check; then one GET.

Every failure is a :class:`ViewError` whose ``kind`` says which (the console counts
them and writes them in the audit log): the station is offline or too slow (a deadline
on connect and on each read), refused (its policy, an unknown prediction, a pruned
image), answered with more than :data:`~fedge.protocols.viewing.MAX_IMAGE_BYTES`, or is
not who it should be. The bytes are returned to the caller, never written anywhere.
"""

import datetime as dt
import http.client
import ssl
from dataclasses import dataclass
from enum import StrEnum
from typing import NoReturn

from cryptography.exceptions import InvalidSignature
from cryptography.x509 import load_der_x509_certificate, load_pem_x509_certificates

from fedge.edge_manager.errors import ManagerError
from fedge.protocols import pki
from fedge.protocols.errors import ProtocolError
from fedge.protocols.pki import Role, TlsFiles
from fedge.protocols.viewing import (
    IMAGE_PATH,
    MAX_IMAGE_BYTES,
    MEDIA_TYPES,
    REASON_HEADER,
    Refusal,
    check_address,
)

DEFAULT_TIMEOUT_S = 3.0


class ViewFailure(StrEnum):
    OFFLINE = "offline"  # no connection, or no answer within the deadline
    REFUSED = "refused"  # the station said no (its reason in ``refusal``)
    TOO_LARGE = "too_large"  # the reply is over MAX_IMAGE_BYTES: refused unread
    IMPOSTOR = "impostor"  # the peer's certificate is not the station's
    BAD_REPLY = "bad_reply"


class ViewError(ManagerError):
    def __init__(self, kind: ViewFailure, message: str, refusal: Refusal | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.refusal = refusal


@dataclass(frozen=True)
class StationImage:
    data: bytes
    media_type: str


def _context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # The station's certificate is checked by _check_station (client-purpose certificate).
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(str(files.cert), str(files.key))
    return context


def _check_station(der: bytes | None, edge: str, files: TlsFiles, now: dt.datetime) -> None:
    if der is None:
        raise ViewError(ViewFailure.IMPOSTOR, f"{edge} presented no certificate")
    try:
        leaf = load_der_x509_certificate(der)
        authorities = load_pem_x509_certificates(files.ca.read_bytes())
        issued = False
        for authority in authorities:
            try:
                leaf.verify_directly_issued_by(authority)
                issued = True
            except (ValueError, TypeError, InvalidSignature):
                continue
        info = pki.cert_info(leaf)
        revoked = (
            pki.revoked_serials(files.crl.read_bytes())
            if files.crl is not None and files.crl.exists()
            else frozenset()
        )
    except (OSError, ValueError, ProtocolError) as exc:
        raise ViewError(
            ViewFailure.IMPOSTOR, f"{edge}'s certificate cannot be checked: {exc}"
        ) from None
    problem = None
    if not issued:
        problem = "is not from the fleet's CA"
    elif not info.not_before <= now <= info.not_after:
        problem = "is out of its dates"
    elif info.role is not Role.EDGE or info.identity != edge:
        problem = f"names {info.identity!r} ({info.role}), not the station {edge}"
    elif info.serial in revoked:
        problem = "is revoked"
    if problem is not None:
        raise ViewError(
            ViewFailure.IMPOSTOR,
            f"the peer at {edge}'s image address presented a certificate that {problem}; "
            "nothing was asked",
        )


def fetch_image(
    files: TlsFiles,
    edge: str,
    images_at: str,
    prediction_id: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bytes: int = MAX_IMAGE_BYTES,
) -> StationImage:
    """The image ``edge`` kept for ``prediction_id``, asked at ``images_at`` (host:port)."""
    try:
        host, port = check_address(images_at)
    except ProtocolError as exc:
        raise ViewError(
            ViewFailure.BAD_REPLY, f"{edge} states a bad image address: {exc}"
        ) from None
    try:
        context = _context(files)
    except (OSError, ssl.SSLError) as exc:
        raise ManagerError(f"cannot load the manager's TLS files: {exc}") from None
    connection = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=context)
    try:
        try:
            connection.connect()
        except (OSError, ssl.SSLError) as exc:  # refused, unreachable, handshake, timeout
            raise ViewError(
                ViewFailure.OFFLINE,
                f"{edge} did not answer at {images_at} within {timeout_s:g} s ({exc}); is "
                "its agent running and reachable from the manager?",
            ) from None
        sock = connection.sock
        der = sock.getpeercert(binary_form=True) if isinstance(sock, ssl.SSLSocket) else None
        _check_station(der, edge, files, pki.utcnow())
        try:
            connection.request("GET", IMAGE_PATH + prediction_id)
            response = connection.getresponse()
            length = int(response.getheader("Content-Length") or -1)
            if response.status == 200 and not 0 <= length <= max_bytes:
                raise ViewError(
                    ViewFailure.TOO_LARGE,
                    f"{edge} offered {length} bytes for {prediction_id}; over the "
                    f"{max_bytes}-byte limit, refused unread",
                )
            body = response.read(max_bytes + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise ViewError(
                ViewFailure.OFFLINE, f"{edge} stopped answering within {timeout_s:g} s ({exc})"
            ) from None
    finally:
        connection.close()
    if response.status != 200:
        _refused(edge, prediction_id, response.getheader(REASON_HEADER) or "", body)
    if len(body) != length:
        raise ViewError(ViewFailure.BAD_REPLY, f"{edge} sent {len(body)} of {length} bytes")
    media = (response.getheader("Content-Type") or "").split(";")[0].strip()
    if media not in MEDIA_TYPES.values():
        raise ViewError(ViewFailure.BAD_REPLY, f"{edge} sent {media!r}, not an image type")
    return StationImage(body, media)


def _refused(edge: str, prediction_id: str, reason: str, body: bytes) -> NoReturn:
    try:
        refusal = Refusal(reason)
    except ValueError:
        raise ViewError(ViewFailure.BAD_REPLY, f"{edge} answered without a reason") from None
    said = body[:300].decode("utf-8", "replace")
    raise ViewError(
        ViewFailure.REFUSED,
        f"{edge} refused to send {prediction_id}'s image ({refusal.value}): {said}",
        refusal,
    )
